// Lets a host C++ compiler parse kvd_kernels.cu (scripts/test.sh: `g++ -fsyntax-only
// -include host-syntax-shim.h -x c++ kvd_kernels.cu`), so a syntax error in the kernels
// fails CI on machines without a GPU. NVRTC compiles the real thing at run time.
#include <math.h>
#include <stddef.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct kvd_dim3 { unsigned x, y, z; };
static kvd_dim3 blockIdx, threadIdx, blockDim;
static void __syncthreads() {}
static float __shfl_xor_sync(unsigned, float v, int) { return v; }
static float rsqrtf(float x) { return 1.0f / sqrtf(x); }
