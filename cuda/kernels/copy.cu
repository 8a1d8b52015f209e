// The GPU tier's copy kernel (cuda/src/copy.rs loads the PTX made from this file,
// cuda/kernels/copy.ptx; daemon/tests/copy_kernel.rs keeps the two in step).
//
// One launch moves every chunk of a copy job. The planner (gpu/src/plan.rs) has
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

// The writer checksum of each piece a gpu_store copies (SPEC §17), computed on the device
// where its bytes are, over the piece's source (engine memory): the CRC-32C of
// chunks[c].src..+len into out[c] (chunks[c].dst is not read). One CUDA block per piece:
// each thread computes the CRC of one segment with no initial value, moves it to the end
// of the piece by x^(8 * bytes after it) mod P, the block XORs the threads' results, and
// thread 0 applies the initial value and the final inversion. gpu/src/crc.rs has
// a CPU model of this exact computation (`segmented`), tested against the CRC-32C.

#define KVD_CRC_POLY 0x82F63B78u

// a * b mod P, reflected (bit 31 is x^0); a is an operator x^k mod P, never 0.
__device__ __forceinline__ unsigned kvd_multmodp(unsigned a, unsigned b) {
    unsigned m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        if (m == 0) break;
        b = (b & 1) ? (b >> 1) ^ KVD_CRC_POLY : b >> 1;
    }
    return p;
}

// x^(8 n) mod P: appends n zero bytes to a CRC with no initial value.
__device__ unsigned kvd_x8nmodp(unsigned long long n) {
    unsigned p = 1u << 31, sq = 1u << 23;
    while (n) {
        if (n & 1) p = kvd_multmodp(sq, p);
        sq = kvd_multmodp(sq, sq);
        n >>= 1;
    }
    return p;
}

extern "C" __global__ void __launch_bounds__(256) kvd_crc32c_chunks(const kvd_chunk* __restrict__ chunks,
                                                                    unsigned int n, unsigned* __restrict__ out) {
    __shared__ unsigned tab[256];
    __shared__ kvd_chunk k;
    __shared__ unsigned warp[8];
    for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned c = i;
        for (int j = 0; j < 8; j++) c = (c & 1) ? (c >> 1) ^ KVD_CRC_POLY : c >> 1;
        tab[i] = c;
    }
    for (unsigned int c = blockIdx.x; c < n; c += gridDim.x) {
        if (threadIdx.x == 0) k = chunks[c];
        __syncthreads();
        const unsigned char* __restrict__ s = (const unsigned char*)k.src;
        const unsigned long long len = k.len;
        const unsigned long long per = (len + blockDim.x - 1) / blockDim.x;
        unsigned long long start = per * threadIdx.x;
        if (start > len) start = len;
        unsigned long long end = start + per;
        if (end > len) end = len;
        unsigned crc = 0;
        for (unsigned long long i = start; i < end; i++) crc = tab[(crc ^ __ldg(s + i)) & 0xff] ^ (crc >> 8);
        if (crc) crc = kvd_multmodp(kvd_x8nmodp(len - end), crc);
        for (int o = 16; o > 0; o >>= 1) crc ^= __shfl_xor_sync(0xffffffffu, crc, o);
        if ((threadIdx.x & 31) == 0) warp[threadIdx.x >> 5] = crc;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned r = 0;
            for (unsigned w = 0; w < (blockDim.x + 31) / 32; w++) r ^= warp[w];
            r ^= kvd_multmodp(kvd_x8nmodp(len), 0xFFFFFFFFu);
            out[c] = r ^ 0xFFFFFFFFu;
        }
        // Every thread is done with `k` and `warp` before the next piece overwrites them.
        __syncthreads();
    }
}
