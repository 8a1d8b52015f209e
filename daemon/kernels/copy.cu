// The GPU tier's copy kernel (daemon/src/gpu/cuda.rs loads the PTX made from this file,
// daemon/kernels/copy.ptx; daemon/tests/copy_kernel.rs keeps the two in step).
//
// One launch moves every chunk of a copy job. The planner (daemon/src/gpu/plan.rs) has
// already checked each piece against its memory and split it into chunks of at most
// KVD_CHUNK bytes whose source, destination and length are multiples of 16; the pieces
// it cannot give the kernel go to the copy engine instead. Addresses are device-visible:
// engine memory opened from an IPC handle, or the page-locked pool through its device
// mapping (cuMemHostRegister with DEVICEMAP), so one launch reads or writes host memory
// over the link in 16-byte accesses, as many in flight as the SMs allow.
//
// Index arithmetic is per chunk (one table entry per CUDA block, read once into shared
// memory), not per element. plan.rs's tests run a CPU model of this exact loop.

struct kvd_chunk {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

#define KVD_UNROLL 4

extern "C" __global__ void __launch_bounds__(512) kvd_copy_chunks(const kvd_chunk* __restrict__ chunks,
                                                                  unsigned int n) {
    __shared__ kvd_chunk k;
    for (unsigned int c = blockIdx.x; c < n; c += gridDim.x) {
        if (threadIdx.x == 0) k = chunks[c];
        __syncthreads();
        const uint4* __restrict__ s = (const uint4*)k.src;
        uint4* __restrict__ d = (uint4*)k.dst;
        const unsigned long long n16 = k.len >> 4;
        const unsigned long long step = blockDim.x;
        unsigned long long i = threadIdx.x;
        // KVD_UNROLL loads in flight per thread before their stores: reads over the link
        // are long, and only many outstanding ones fill it.
        for (; i + (KVD_UNROLL - 1) * step < n16; i += KVD_UNROLL * step) {
            uint4 v[KVD_UNROLL];
#pragma unroll
            for (int u = 0; u < KVD_UNROLL; u++) v[u] = s[i + u * step];
#pragma unroll
            for (int u = 0; u < KVD_UNROLL; u++) d[i + u * step] = v[u];
        }
        for (; i < n16; i += step) d[i] = s[i];
        // Every thread is done with `k` before thread 0 reads the next chunk into it.
        __syncthreads();
    }
}
