// Back-to-back dependent kernels on one stream: how much of the time between them programmatic
// dependent launch (PDL) and CUDA graphs take away. A bench step spends ~5 ms in ~3,000 gaps of
// ~1.7 us between consecutive kernels (docs/performance.md, "A trace of untimed steps"); this
// measures what each way of launching would leave, before the trainer is changed for it.
//
// For two kernel sizes, K kernels run where each reads the buffer the one before wrote, four ways:
// plain launches; PDL launches (cudaLaunchKernelEx with programmatic stream serialisation; the
// kernel waits for its predecessor with griddepcontrol.wait before touching memory and lets its own
// successor launch at once); a captured graph of the plain launches; a graph of the PDL launches.
// A spinning kernel holds the stream while the host queues the K launches, so the host's launch
// rate does not enter the times. Prints microseconds per kernel and checks that every way leaves
// the plain launches' result bit for bit (a PDL kernel reading too early would not). Ends with
// PASS or FAIL. CMake builds it with the CUDA code (target launch_probe); on a GPU machine:
//   build-gpu/launch_probe        (tools/gpu_probe.sh launch)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define PROBE_CHECK(call)                                                                             \
  do {                                                                                                \
    const cudaError_t status_ = (call);                                                               \
    if (status_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\nFAIL\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_)); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

namespace {

constexpr int kKernels = 2000, kThreads = 256;

// out = in * 0.999 + 1, elementwise; with Pdl the predecessor's writes are waited for first.
template <bool Pdl> __global__ void step_kernel(float4* out, const float4* in, int64_t n4) {
  if constexpr (Pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    out[i] = make_float4(fmaf(v.x, 0.999f, 1.0f), fmaf(v.y, 0.999f, 1.0f), fmaf(v.z, 0.999f, 1.0f), fmaf(v.w, 0.999f, 1.0f));
  }
}

// Holds the stream for `cycles` GPU clock cycles.
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

enum class Mode { plain, pdl, graph, graph_pdl };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::plain: return "plain launches";
    case Mode::pdl: return "PDL launches";
    case Mode::graph: return "graph of plain launches";
    case Mode::graph_pdl: return "graph of PDL launches";
  }
  return "";
}

void launch_chain(bool pdl, float4* a, float4* b, int64_t n4, unsigned blocks, cudaStream_t s) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreads);
  config.stream = s;
  config.attrs = pdl ? &attribute : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  for (int k = 0; k < kKernels; ++k) {
    float4* out = k % 2 ? a : b;
    const float4* in = k % 2 ? b : a;
    if (pdl) PROBE_CHECK(cudaLaunchKernelEx(&config, step_kernel<true>, out, in, n4));
    else PROBE_CHECK(cudaLaunchKernelEx(&config, step_kernel<false>, out, in, n4));
  }
}

// Runs the chain from ones in `mode`; returns microseconds per kernel and leaves the result in `result`.
double run(Mode mode, int64_t n4, unsigned blocks, std::vector<float>& result) {
  cudaStream_t s;
  PROBE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float4 *a, *b;
  PROBE_CHECK(cudaMalloc(&a, n4 * sizeof(float4)));
  PROBE_CHECK(cudaMalloc(&b, n4 * sizeof(float4)));
  const std::vector<float> ones(size_t(4 * n4), 1.0f);
  PROBE_CHECK(cudaMemcpy(a, ones.data(), n4 * sizeof(float4), cudaMemcpyHostToDevice));
  cudaGraphExec_t exec = nullptr;
  const bool graph = mode == Mode::graph || mode == Mode::graph_pdl, pdl = mode == Mode::pdl || mode == Mode::graph_pdl;
  if (graph) {
    cudaGraph_t g;
    PROBE_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    launch_chain(pdl, a, b, n4, blocks, s);
    PROBE_CHECK(cudaStreamEndCapture(s, &g));
    PROBE_CHECK(cudaGraphInstantiate(&exec, g, 0));
    PROBE_CHECK(cudaGraphDestroy(g));
  }
  cudaEvent_t start, stop;
  PROBE_CHECK(cudaEventCreate(&start));
  PROBE_CHECK(cudaEventCreate(&stop));
  spin_kernel<<<1, 1, 0, s>>>(200'000'000);  // ~0.1 s: the host queues everything behind it
  PROBE_CHECK(cudaGetLastError());
  PROBE_CHECK(cudaEventRecord(start, s));
  if (graph) PROBE_CHECK(cudaGraphLaunch(exec, s));
  else launch_chain(pdl, a, b, n4, blocks, s);
  PROBE_CHECK(cudaEventRecord(stop, s));
  PROBE_CHECK(cudaStreamSynchronize(s));
  float ms = 0;
  PROBE_CHECK(cudaEventElapsedTime(&ms, start, stop));
  result.resize(size_t(4 * n4));
  PROBE_CHECK(cudaMemcpy(result.data(), kKernels % 2 ? b : a, n4 * sizeof(float4), cudaMemcpyDeviceToHost));
  if (exec) PROBE_CHECK(cudaGraphExecDestroy(exec));
  PROBE_CHECK(cudaEventDestroy(start));
  PROBE_CHECK(cudaEventDestroy(stop));
  PROBE_CHECK(cudaFree(a));
  PROBE_CHECK(cudaFree(b));
  PROBE_CHECK(cudaStreamDestroy(s));
  return 1000.0 * ms / kKernels;
}

}  // namespace

int main() {
  int sms = 0;
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  bool same = true;
  // 1 MiB (a few microseconds: the size of most elementwise kernels of a step) and 32 MiB per buffer.
  for (const int64_t bytes : {int64_t(1) << 20, int64_t(32) << 20}) {
    const int64_t n4 = bytes / 16;
    const unsigned blocks = unsigned(std::min<int64_t>((n4 + kThreads - 1) / kThreads, 4 * sms));
    std::printf("%lld KiB a buffer, %d dependent kernels of %u blocks:\n", (long long)(bytes >> 10), kKernels, blocks);
    std::vector<float> reference, result;
    double plain = 0;
    for (Mode m : {Mode::plain, Mode::pdl, Mode::graph, Mode::graph_pdl}) {
      const double us = run(m, n4, blocks, m == Mode::plain ? reference : result);
      if (m == Mode::plain) plain = us;
      const bool equal = m == Mode::plain || std::memcmp(result.data(), reference.data(), result.size() * sizeof(float)) == 0;
      same = same && equal;
      std::printf("  %-26s %7.2f us a kernel  (%+.2f against plain)%s\n", mode_name(m), us, us - plain,
                  equal ? "" : "  RESULT DIFFERS from the plain launches'");
    }
  }
  std::printf("%s\n", same ? "PASS" : "FAIL");
  return same ? 0 : 1;
}
