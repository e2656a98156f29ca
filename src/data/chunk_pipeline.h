// Runs work on the chunks of a ChunkReader with worker threads and hands the results back on the
// calling thread in chunk order, so what the caller builds does not depend on the thread count.
// An error anywhere (reader, worker, consumer) stops every thread and is rethrown to the caller at
// the point in chunk order where it happened.
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "data/corpus_reader.h"

namespace marrow {

// --threads of tokenize and train-tokenizer: far beyond any machine's cores, below the point where
// the system refuses to start more threads.
constexpr int kMaxPipelineThreads = 1024;
inline void check_pipeline_threads(int threads) {
  MARROW_CHECK(threads >= 1 && threads <= kMaxPipelineThreads, "--threads must be between 1 and {}, got {}", kMaxPipelineThreads, threads);
}

// One reader thread fills `queued` (at most max_in_flight chunks ahead of the consumer), the
// workers move chunks from `queued` to `finished`, and the calling thread consumes `finished` in
// chunk order; every wait is on one condition variable, notified at each change.
template <typename Result> class ChunkPipeline {
 public:
  using Work = std::function<Result(const TextChunk&, int worker)>;
  using Consume = std::function<void(Result&)>;
  ChunkPipeline(ChunkReader& reader, int threads, const Work& work, const Consume& consume)
      : reader_(reader), threads_(threads), work_(work), consume_(consume), max_in_flight_(size_t(threads) * 2 + 2) {}

  void run() {
    struct JoinOnExit {
      ChunkPipeline& pipeline;
      ~JoinOnExit() {
        pipeline.stop_all();
        for (auto& t : pipeline.pool_) t.join();
      }
    } join_on_exit{*this};
    pool_.emplace_back([this] { read_chunks(); });
    for (int w = 0; w < threads_; ++w) pool_.emplace_back([this, w] { work_on_chunks(w); });
    consume_in_order();
  }

 private:
  struct Slot {
    std::optional<Result> result;
    std::exception_ptr error;
  };

  void stop_all() {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }

  void read_chunks() {
    for (;;) {
      TextChunk chunk;
      std::exception_ptr error;
      bool more = false;
      try {
        more = reader_.next(chunk);
      } catch (...) {
        error = std::current_exception();
      }
      std::unique_lock lock(mutex_);
      if (error || !more) {
        reader_error_ = error;
        reading_done_ = true;
        changed_.notify_all();
        return;
      }
      queued_.emplace(chunks_read_++, std::move(chunk));
      changed_.notify_all();
      changed_.wait(lock, [&] { return stopping_ || chunks_read_ - consumed_ < max_in_flight_; });
      if (stopping_) return;
    }
  }

  void work_on_chunks(int worker) {
    for (;;) {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || !queued_.empty() || reading_done_; });
      if (stopping_ || queued_.empty()) return;
      auto node = queued_.extract(queued_.begin());
      lock.unlock();
      Slot slot;
      try {
        slot.result.emplace(work_(node.mapped(), worker));
      } catch (...) {
        slot.error = std::current_exception();
      }
      lock.lock();
      finished_.emplace(node.key(), std::move(slot));
      changed_.notify_all();
    }
  }

  void consume_in_order() {
    for (uint64_t next = 0;; ++next) {
      Slot slot;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return finished_.count(next) || (reading_done_ && next >= chunks_read_); });
        if (!finished_.count(next)) {
          if (reader_error_) std::rethrow_exception(reader_error_);
          return;
        }
        slot = std::move(finished_.extract(next).mapped());
        ++consumed_;
        changed_.notify_all();
      }
      if (slot.error) std::rethrow_exception(slot.error);
      consume_(*slot.result);
    }
  }

  ChunkReader& reader_;
  const int threads_;
  const Work& work_;
  const Consume& consume_;
  const size_t max_in_flight_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<uint64_t, TextChunk> queued_;
  std::map<uint64_t, Slot> finished_;
  uint64_t chunks_read_ = 0, consumed_ = 0;
  bool reading_done_ = false, stopping_ = false;
  std::exception_ptr reader_error_;
  std::vector<std::jthread> pool_;
};

template <typename Result>
void run_chunk_pipeline(ChunkReader& reader, int threads, const std::function<Result(const TextChunk&, int worker)>& work,
                        const std::function<void(Result&)>& consume) {
  ChunkPipeline<Result>(reader, threads, work, consume).run();
}

}  // namespace marrow
