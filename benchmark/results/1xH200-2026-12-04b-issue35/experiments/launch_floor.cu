// Per-call time of tiny kernels captured 20 to a CUDA graph on one stream (median of 50
// replays): parameter size, parameters read, cluster launch, PDL.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

template <int N> struct Blob { unsigned long long w[N / 8]; };

template <int N>
__global__ void empty_kernel(const Blob<N> b) {}

template <int N>
__global__ void reads_kernel(const Blob<N> b, unsigned long long* sink) {
  unsigned long long acc = 0;
#pragma unroll
  for (int i = 0; i < N / 8; ++i) acc += b.w[i];
  if (threadIdx.x == 9999) *sink = acc;
}

__global__ void pdl_kernel(const Blob<408> b, int trigger_early) {
  if (trigger_early) asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!trigger_early) asm volatile("griddepcontrol.launch_dependents;");
}

template <typename Launch>
float per_call_us(Launch launch, cudaStream_t s) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  for (int i = 0; i < 3; ++i) launch();
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 20; ++i) launch();
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < 51; ++r) {
    cudaEventRecord(a, s);
    CHECK(cudaGraphLaunch(ge, s));
    cudaEventRecord(b, s);
    CHECK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (r) t.push_back(ms * 1000.f / 20.f);
  }
  std::sort(t.begin(), t.end());
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return t[t.size() / 2];
}

int main() {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long* sink;
  CHECK(cudaMalloc(&sink, 8));
  const dim3 grid(4), block(512);
  auto plain = [&](auto kernel, auto... args) {
    return [=]() {
      cudaLaunchConfig_t c = {};
      c.gridDim = grid; c.blockDim = block; c.stream = s;
      CHECK(cudaLaunchKernelEx(&c, kernel, args...));
    };
  };
  auto clustered = [&](int size, auto kernel, auto... args) {
    return [=]() {
      cudaLaunchAttribute attr = {};
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = size; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t c = {};
      c.gridDim = grid; c.blockDim = block; c.stream = s; c.attrs = &attr; c.numAttrs = 1;
      CHECK(cudaLaunchKernelEx(&c, kernel, args...));
    };
  };
  auto pdl = [&](int early) {
    return [=]() {
      cudaLaunchAttribute attr = {};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t c = {};
      c.gridDim = grid; c.blockDim = block; c.stream = s; c.attrs = &attr; c.numAttrs = 1;
      CHECK(cudaLaunchKernelEx(&c, pdl_kernel, Blob<408>{}, early));
    };
  };
  for (int round = 0; round < 2; ++round) {
    printf("round %d, grid 4 x 512, us per call:\n", round);
    printf("  empty, 8 B params      %.3f\n", per_call_us(plain(empty_kernel<8>, Blob<8>{}), s));
    printf("  empty, 408 B params    %.3f\n", per_call_us(plain(empty_kernel<408>, Blob<408>{}), s));
    printf("  empty, 480 B params    %.3f\n", per_call_us(plain(empty_kernel<480>, Blob<480>{}), s));
    printf("  empty, 2048 B params   %.3f\n", per_call_us(plain(empty_kernel<2048>, Blob<2048>{}), s));
    printf("  reads 408 B params     %.3f\n", per_call_us(plain(reads_kernel<408>, Blob<408>{}, sink), s));
    printf("  reads 480 B params     %.3f\n", per_call_us(plain(reads_kernel<480>, Blob<480>{}, sink), s));
    printf("  empty, cluster of 2    %.3f\n", per_call_us(clustered(2, empty_kernel<408>, Blob<408>{}), s));
    printf("  empty, cluster of 4    %.3f\n", per_call_us(clustered(4, empty_kernel<408>, Blob<408>{}), s));
    printf("  PDL, trigger at end    %.3f\n", per_call_us(pdl(0), s));
    printf("  PDL, trigger at start  %.3f\n", per_call_us(pdl(1), s));
  }
  return 0;
}
