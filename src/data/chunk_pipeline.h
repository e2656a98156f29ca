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

template <typename Result>
void run_chunk_pipeline(ChunkReader& reader, int threads, const std::function<Result(const TextChunk&, int worker)>& work,
                        const std::function<void(Result&)>& consume) {
  struct Slot {
    std::optional<Result> result;
    std::exception_ptr error;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::map<uint64_t, TextChunk> queued;
  std::map<uint64_t, Slot> finished;
  uint64_t chunks_read = 0, consumed = 0;
  bool reading_done = false, stopping = false;
  std::exception_ptr reader_error;
  const size_t max_in_flight = size_t(threads) * 2 + 2;

  auto stop_all = [&] {
    std::lock_guard lock(mutex);
    stopping = true;
    changed.notify_all();
  };
  std::vector<std::jthread> pool;
  struct JoinOnExit {
    std::function<void()> stop;
    std::vector<std::jthread>& pool;
    ~JoinOnExit() {
      stop();
      for (auto& t : pool) t.join();
    }
  } join_on_exit{stop_all, pool};

  pool.emplace_back([&] {
    for (;;) {
      TextChunk chunk;
      std::exception_ptr error;
      bool more = false;
      try {
        more = reader.next(chunk);
      } catch (...) {
        error = std::current_exception();
      }
      std::unique_lock lock(mutex);
      if (error || !more) {
        reader_error = error;
        reading_done = true;
        changed.notify_all();
        return;
      }
      queued.emplace(chunks_read++, std::move(chunk));
      changed.notify_all();
      changed.wait(lock, [&] { return stopping || chunks_read - consumed < max_in_flight; });
      if (stopping) return;
    }
  });
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      for (;;) {
        std::unique_lock lock(mutex);
        changed.wait(lock, [&] { return stopping || !queued.empty() || reading_done; });
        if (stopping || queued.empty()) return;
        auto node = queued.extract(queued.begin());
        lock.unlock();
        Slot slot;
        try {
          slot.result.emplace(work(node.mapped(), w));
        } catch (...) {
          slot.error = std::current_exception();
        }
        lock.lock();
        finished.emplace(node.key(), std::move(slot));
        changed.notify_all();
      }
    });
  }

  for (uint64_t next = 0;; ++next) {
    Slot slot;
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] { return finished.count(next) || (reading_done && next >= chunks_read); });
      if (!finished.count(next)) {
        if (reader_error) std::rethrow_exception(reader_error);
        return;
      }
      slot = std::move(finished.extract(next).mapped());
      ++consumed;
      changed.notify_all();
    }
    if (slot.error) std::rethrow_exception(slot.error);
    consume(*slot.result);
  }
}

}  // namespace marrow
