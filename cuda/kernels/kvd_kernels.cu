// kvd-model kernels, compiled at run time with NVRTC (cuda/src/model_kernels.rs launches them).
// Each kernel has a CPU reference in model/src/cpu.rs with the same meaning; the tests
// compare them. All tensors are f32, row-major; the paged KV cache is
// [layer][part][block][token][kv_head][head_dim].

typedef unsigned long long u64;

// +inf without <math.h> (NVRTC has no INFINITY macro): the IEEE-754 bit pattern.
#define KVD_INF __int_as_float(0x7f800000)

__device__ __forceinline__ size_t cache_index(int layer, int part, int block, int token, int head,
                                              int num_blocks, int bt, int kvh, int hd) {
    return ((((size_t)(layer * 2 + part) * num_blocks + block) * bt + token) * kvh + head) * hd;
}

extern "C" __global__ void embedding(const float* table, const unsigned* tokens, float* out, int n, int dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * dim) return;
    size_t t = i / dim, d = i % dim;
    out[i] = table[(size_t)tokens[t] * dim + d];
}

// One block (256 threads) per row.
extern "C" __global__ void rmsnorm(const float* x, const float* w, float* out, int rows, int dim, float eps) {
    __shared__ float part[256];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * dim;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    float inv = rsqrtf(part[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)r * dim + i] = xr[i] * inv * w[i];
}

// out[m][n] = x[m][k] . w[n][k]; 16x16 tiles (used when cuBLAS is not there).
extern "C" __global__ void matmul(const float* x, const float* w, float* out, int m, int n, int k) {
    __shared__ float xs[16][17];
    __shared__ float ws[16][17];
    int row = blockIdx.y * 16 + threadIdx.y;
    int col = blockIdx.x * 16 + threadIdx.x;
    float acc = 0.f;
    for (int k0 = 0; k0 < k; k0 += 16) {
        int kx = k0 + threadIdx.x;
        xs[threadIdx.y][threadIdx.x] = (row < m && kx < k) ? x[(size_t)row * k + kx] : 0.f;
        int wrow = blockIdx.x * 16 + threadIdx.y;
        ws[threadIdx.y][threadIdx.x] = (wrow < n && kx < k) ? w[(size_t)wrow * k + kx] : 0.f;
        __syncthreads();
        for (int i = 0; i < 16; i++) acc += xs[threadIdx.y][i] * ws[threadIdx.x][i];
        __syncthreads();
    }
    if (row < m && col < n) out[(size_t)row * n + col] = acc;
}

// `inv_freq[p]` turns pair p (the model computes the table: base, then llama3 or yarn
// scaling); the cosine and sine are multiplied by `scale` (yarn's attention factor, else 1).
// Elements offset..offset+dim of each (token, head) row of `stride` floats turn (the whole
// head, or MLA's RoPE part of a query head or a latent row).
extern "C" __global__ void rope(float* x, const unsigned* pos, int tokens, int heads, int stride, int offset, int dim,
                               const float* inv_freq, float scale) {
    int half = dim / 2;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * heads * half) return;
    int p = i % half;
    size_t th = i / half;
    int t = th / heads;
    float s, c;
    sincosf((float)pos[t] * inv_freq[p], &s, &c);
    s *= scale;
    c *= scale;
    float* base = x + th * stride + offset;
    float a = base[p], b = base[p + half];
    base[p] = a * c - b * s;
    base[p + half] = b * c + a * s;
}

// K (and V, with two parts) rows of new tokens into the cache; one part: a latent row.
extern "C" __global__ void write_kv(float* cache, const float* k, const float* v, const unsigned* slots, int n,
                                   int layer, int num_blocks, int bt, int kvh, int hd, int parts) {
    size_t row = (size_t)kvh * hd;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * row) return;
    int t = i / row;
    size_t e = i % row;
    unsigned slot = slots[t];
    int blk = slot / bt, off = slot % bt;
    size_t lp = (size_t)layer * parts;
    cache[((((lp)*num_blocks + blk) * bt + off) * kvh) * hd + e] = k[i];
    if (parts == 2) cache[((((lp + 1) * num_blocks + blk) * bt + off) * kvh) * hd + e] = v[i];
}

// RMSNorm in place of elements 0..dim of each row of `stride` floats (MLA's latent, which
// shares its row with the RoPE key). One block (256 threads) per row.
extern "C" __global__ void rmsnorm_at(float* x, const float* w, int rows, int stride, int dim, float eps) {
    __shared__ float part[256];
    int r = blockIdx.x;
    if (r >= rows) return;
    float* xr = x + (size_t)r * stride;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    float inv = rsqrtf(part[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] = xr[i] * inv * w[i];
}

// MLA's absorbed query, a thread per (row, head, i): i < r: the head's key expansion
// (wkbt[head], [r][nope]) times its no-RoPE part; then its RoPE part as is.
extern "C" __global__ void mla_absorb(const float* q, const float* wkbt, float* out, int rows, int heads, int nope,
                                     int rope, int r) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int w = r + rope;
    if (i >= (size_t)rows * heads * w) return;
    int c = i % w;
    size_t th = i / w;
    int h = th % heads;
    const float* qh = q + th * (nope + rope);
    if (c < r) {
        const float* wr = wkbt + ((size_t)h * r + c) * nope;
        float s = 0.f;
        for (int k = 0; k < nope; k++) s += wr[k] * qh[k];
        out[i] = s;
    } else {
        out[i] = qh[nope + c - r];
    }
}

// MLA's values, a thread per (row, head, j): the head's value expansion (wvb[head],
// [v][r]) times its attended latent.
extern "C" __global__ void mla_unabsorb(const float* olat, const float* wvb, float* out, int rows, int heads, int r,
                                       int v) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * heads * v) return;
    int j = i % v;
    size_t th = i / v;
    int h = th % heads;
    const float* l = olat + th * r;
    const float* wr = wvb + ((size_t)h * v + j) * r;
    float s = 0.f;
    for (int k = 0; k < r; k++) s += wr[k] * l[k];
    out[i] = s;
}

#define MLA_MAX_DV 512

// MLA attention: one warp per (token, head) over the layer's latent rows (one part, one
// head, dk wide); each lane keeps an online softmax over its rows and the first dv
// elements of their weighted sum, then the lanes are merged with shuffles. dv <= 512.
extern "C" __global__ void mla_attention(const float* q, const float* cache, const unsigned* block_table,
                                        const unsigned* pos, float* out, int tokens, int heads, int dk, int dv, int bt,
                                        int num_blocks, int layer, float scale) {
    int th = blockIdx.x;
    if (th >= tokens * heads) return;
    int t = th / heads;
    int lane = threadIdx.x;
    const float* qr = q + (size_t)th * dk;
    float m = -KVD_INF, l = 0.f;
    float acc[MLA_MAX_DV];
    for (int d = 0; d < dv; d++) acc[d] = 0.f;
    int n = pos[t] + 1;
    for (int j = lane; j < n; j += 32) {
        int blk = block_table[j / bt];
        const float* row = cache + (((size_t)layer * num_blocks + blk) * bt + j % bt) * dk;
        float s = 0.f;
        for (int d = 0; d < dk; d++) s += qr[d] * row[d];
        s *= scale;
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        for (int d = 0; d < dv; d++) acc[d] = acc[d] * corr + p * row[d];
        m = mn;
    }
    float M = m;
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, o));
    float f = (m == -KVD_INF) ? 0.f : expf(m - M);
    float L = l * f;
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffff, L, o);
    for (int d = 0; d < dv; d++) {
        float a = acc[d] * f;
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffff, a, o);
        if (lane == 0) out[(size_t)th * dv + d] = a / L;
    }
}

// x[i] *= sigmoid(gate[i]): an output gate.
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, int n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)n) x[i] *= 1.f / (1.f + expf(-gate[i]));
}

// Gated DeltaNet, step 1: a thread per channel runs the causal depthwise convolution
// over rows row0.. in order, from and into its history (`hist`: [cd][K-1], oldest
// first), and writes SiLU of each output to xout[t][c].
extern "C" __global__ void gdn_conv(const float* qkv, const float* conv, float* hist, float* xout, int row0,
                                   int rows, int cd, int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    float* h = hist + (size_t)c * (K - 1);
    const float* w = conv + (size_t)c * K;
    for (int t = row0; t < row0 + rows; t++) {
        float x = qkv[(size_t)t * cd + c];
        float acc = w[K - 1] * x;
        for (int j = 0; j < K - 1; j++) acc += w[j] * h[j];
        for (int j = 0; j < K - 2; j++) h[j] = h[j + 1];
        h[K - 2] = x;
        xout[(size_t)t * cd + c] = acc / (1.f + expf(-acc));
    }
}

#define GDN_MAX_DK 256

// Gated DeltaNet, step 2: a block per value head, a thread per value element j (blockDim
// >= dv), over rows in order. Thread j keeps column j of the head's state (dk <= 256) and
// applies the gated delta rule; the head's read is RMS-normed, scaled and gated by
// silu(z). Shared memory: (2 dk + 2 + blockDim) floats.
extern "C" __global__ void gdn_rule(const float* xc, const float* z, const float* b, const float* a,
                                   const float* neg_a, const float* dt_bias, const float* norm, float* st,
                                   float* out, int row0, int rows, int hk, int hv, int dk, int dv, float eps) {
    extern __shared__ float sh[];
    float* qn = sh;
    float* kn = sh + dk;
    float* red = sh + 2 * dk;
    int h = blockIdx.x, j = threadIdx.x;
    int kh = h / (hv / hk);
    int cd = 2 * hk * dk + hv * dv;
    float* S = st + (size_t)h * dk * dv;
    float col[GDN_MAX_DK];
    if (j < dv)
        for (int i = 0; i < dk; i++) col[i] = S[(size_t)i * dv + j];
    float scale = rsqrtf((float)dk);
    for (int t = row0; t < row0 + rows; t++) {
        const float* x = xc + (size_t)t * cd;
        const float* q = x + kh * dk;
        const float* k = x + hk * dk + kh * dk;
        const float* v = x + 2 * hk * dk + h * dv;
        if (j == 0) {
            float sq = 0.f, sk = 0.f;
            for (int i = 0; i < dk; i++) {
                sq += q[i] * q[i];
                sk += k[i] * k[i];
            }
            float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
            for (int i = 0; i < dk; i++) {
                qn[i] = q[i] * iq * scale;
                kn[i] = k[i] * ik;
            }
            float xa = a[(size_t)t * hv + h] + dt_bias[h];
            float sp = xa > 20.f ? xa : log1pf(expf(xa));
            red[0] = 1.f / (1.f + expf(-b[(size_t)t * hv + h]));
            red[1] = expf(neg_a[h] * sp);
        }
        __syncthreads();
        float o = 0.f;
        if (j < dv) {
            float beta = red[0], decay = red[1], kv = 0.f;
            for (int i = 0; i < dk; i++) {
                col[i] *= decay;
                kv += col[i] * kn[i];
            }
            float delta = (v[j] - kv) * beta;
            for (int i = 0; i < dk; i++) {
                col[i] += kn[i] * delta;
                o += col[i] * qn[i];
            }
        }
        __syncthreads();
        if (j < dv) red[2 + j] = o * o;
        __syncthreads();
        if (j == 0) {
            float ss = 0.f;
            for (int i = 0; i < dv; i++) ss += red[2 + i];
            red[1] = 1.f / sqrtf(ss / dv + eps);
        }
        __syncthreads();
        if (j < dv) {
            size_t at = (size_t)t * hv * dv + (size_t)h * dv + j;
            float zz = z[at];
            out[at] = o * red[1] * norm[j] * (zz / (1.f + expf(-zz)));
        }
        __syncthreads();
    }
    if (j < dv)
        for (int i = 0; i < dk; i++) S[(size_t)i * dv + j] = col[i];
}

// x[r][i] += b[i]: a Linear layer's bias.
extern "C" __global__ void add_rows(float* x, const float* b, int rows, int dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * dim) x[i] += b[i % dim];
}

// One warp per (token, head): each lane keeps an online softmax over its keys, then the
// lanes are merged with shuffles. head_dim <= 256. With `window` > 0 a query reads only
// its last `window` positions (sliding layers); with `has_sinks` the head's sink logit
// joins the softmax's denominator (gpt-oss).
extern "C" __global__ void attention(const float* q, const float* cache, const unsigned* block_table, const unsigned* pos,
                                    float* out, int tokens, int heads, int kvh, int hd, int bt, int num_blocks, int layer,
                                    int window, const float* sinks, int has_sinks) {
    int th = blockIdx.x;
    if (th >= tokens * heads) return;
    int t = th / heads, h = th % heads;
    int g = kvh ? heads / kvh : 1;
    int kh = h / g;
    int lane = threadIdx.x;
    const float* qr = q + (size_t)th * hd;
    float scale = rsqrtf((float)hd);
    float m = -KVD_INF, l = 0.f;
    float acc[256];
    for (int d = 0; d < hd; d++) acc[d] = 0.f;
    int n = pos[t] + 1;
    int lo = (window > 0 && n > window) ? n - window : 0;
    for (int j = lo + lane; j < n; j += 32) {
        int blk = block_table[j / bt];
        const float* kr = cache + cache_index(layer, 0, blk, j % bt, kh, num_blocks, bt, kvh, hd);
        const float* vr = cache + cache_index(layer, 1, blk, j % bt, kh, num_blocks, bt, kvh, hd);
        float s = 0.f;
        for (int d = 0; d < hd; d++) s += qr[d] * kr[d];
        s *= scale;
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        for (int d = 0; d < hd; d++) acc[d] = acc[d] * corr + p * vr[d];
        m = mn;
    }
    float M = m;
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, o));
    float f = (m == -KVD_INF) ? 0.f : expf(m - M);
    float L = l * f;
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffff, L, o);
    float S = 1.f;  // the keys' share once the sink is counted
    if (has_sinks) {
        float sk = sinks[h], M2 = fmaxf(M, sk);
        S = expf(M - M2);
        L = L * S + expf(sk - M2);
    }
    for (int d = 0; d < hd; d++) {
        float a = acc[d] * f;
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffff, a, o);
        if (lane == 0) out[(size_t)th * hd + d] = a * S / L;
    }
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

#define MOE_MAX_GROUPS 64

// A row's router, one thread per row, its experts written in ascending order.
// kind 0 (gpt-oss): the `top_k` largest router logits (ties to the lower expert), softmax
// over them. kind 1 (DeepSeek-V3): sigmoid scores; the choice adds `bias` to them, keeps
// the `topk_groups` of `groups` groups whose two best choices sum highest (ties to the
// lower group), and takes the `top_k` best choices there; the weights are the chosen
// scores, normalized (`normalize`) and times `scale`. groups <= 64.
extern "C" __global__ void moe_route(const float* logits, int rows, int experts, int top_k, unsigned* idx, float* w,
                                    int kind, const float* bias, int groups, int topk_groups, int normalize,
                                    float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* lr = logits + (size_t)r * experts;
    unsigned* ir = idx + (size_t)r * top_k;
    float* wr = w + (size_t)r * top_k;
    if (kind == 1) {
        int per = experts / groups;
        bool keep[MOE_MAX_GROUPS];
        for (int g = 0; g < groups; g++) keep[g] = false;
        for (int k = 0; k < topk_groups; k++) {
            int bg = -1;
            float bs = -KVD_INF;
            for (int g = 0; g < groups; g++) {
                if (keep[g]) continue;
                // the group's two best choices
                float a = -KVD_INF, b2 = -KVD_INF;
                for (int e = g * per; e < (g + 1) * per; e++) {
                    float c = sigmoidf(lr[e]) + bias[e];
                    if (c > a) {
                        b2 = a;
                        a = c;
                    } else if (c > b2) {
                        b2 = c;
                    }
                }
                float gs = per >= 2 ? a + b2 : a;
                if (bg < 0 || gs > bs) {
                    bg = g;
                    bs = gs;
                }
            }
            keep[bg] = true;
        }
        for (int j = 0; j < top_k; j++) {
            int best = -1;
            float bc = -KVD_INF;
            for (int e = 0; e < experts; e++) {
                if (!keep[e / per]) continue;
                bool taken = false;
                for (int i = 0; i < j; i++) taken |= ir[i] == (unsigned)e;
                float c = sigmoidf(lr[e]) + bias[e];
                if (!taken && (best < 0 || c > bc)) {
                    best = e;
                    bc = c;
                }
            }
            ir[j] = (unsigned)best;
        }
        float z = 0.f;
        for (int j = 0; j < top_k; j++) z += sigmoidf(lr[ir[j]]);
        for (int j = 0; j < top_k; j++) {
            float s = sigmoidf(lr[ir[j]]);
            wr[j] = (normalize ? s / (z + 1e-20f) : s) * scale;
        }
    } else {
        for (int j = 0; j < top_k; j++) {
            int best = -1;
            for (int e = 0; e < experts; e++) {
                bool taken = false;
                for (int i = 0; i < j; i++) taken |= ir[i] == (unsigned)e;
                if (!taken && (best < 0 || lr[e] > lr[best])) best = e;
            }
            ir[j] = (unsigned)best;
        }
        float m = lr[ir[0]], z = 0.f;
        for (int j = 0; j < top_k; j++) z += expf(lr[ir[j]] - m);
        for (int j = 0; j < top_k; j++) wr[j] = expf(lr[ir[j]] - m) / z;
    }
    for (int j = 1; j < top_k; j++) {  // insertion sort by expert
        unsigned ei = ir[j];
        float wi = wr[j];
        int i = j - 1;
        for (; i >= 0 && ir[i] > ei; i--) {
            ir[i + 1] = ir[i];
            wr[i + 1] = wr[i];
        }
        ir[i + 1] = ei;
        wr[i + 1] = wi;
    }
}

// act[r][j][i] = the activation of expert idx[r][j]'s gate/up pair i: rows 2i and 2i+1
// of its [2*ffn][dim] gate_up, plus biases. act_kind 0 (gpt-oss): the gate clamped above,
// up both ways, at `limit`, then (up + 1) * gate * sigmoid(alpha * gate); 1: silu(gate) * up.
extern "C" __global__ void moe_up(const float* x, const unsigned* idx, const float* gu, const float* gub, float* act,
                                 int rows, int dim, int top_k, int ffn, float alpha, float limit, int act_kind) {
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)rows * top_k * ffn) return;
    int i = t % ffn;
    size_t rj = t / ffn;
    int r = rj / top_k;
    size_t e = idx[rj];
    const float* xr = x + (size_t)r * dim;
    const float* g = gu + (e * 2 * ffn + 2 * i) * dim;
    const float* u = g + dim;
    float gs = 0.f, us = 0.f;
    for (int d = 0; d < dim; d++) {
        gs += xr[d] * g[d];
        us += xr[d] * u[d];
    }
    gs += gub[e * 2 * ffn + 2 * i];
    us += gub[e * 2 * ffn + 2 * i + 1];
    if (act_kind == 1) {
        act[t] = gs / (1.f + expf(-gs)) * us;
        return;
    }
    gs = fminf(gs, limit);
    us = fminf(fmaxf(us, -limit), limit);
    act[t] = (us + 1.f) * (gs / (1.f + expf(-(gs * alpha))));
}

// out[r][d] = sum over the row's experts (ascending) of w · (down[e][d] · act + down_bias[e][d]).
extern "C" __global__ void moe_down(const float* act, const unsigned* idx, const float* w, const float* dn,
                                   const float* dnb, float* out, int rows, int dim, int top_k, int ffn) {
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)rows * dim) return;
    int r = t / dim, d = t % dim;
    float o = 0.f;
    for (int j = 0; j < top_k; j++) {
        size_t rj = (size_t)r * top_k + j, e = idx[rj];
        const float* a = act + rj * ffn;
        const float* wr = dn + (e * dim + d) * ffn;
        float y = 0.f;
        for (int i = 0; i < ffn; i++) y += a[i] * wr[i];
        o += (y + dnb[e * dim + d]) * w[rj];
    }
    out[t] = o;
}

extern "C" __global__ void swiglu(const float* gate, const float* up, float* out, int n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n) return;
    float g = gate[i];
    out[i] = g / (1.f + expf(-g)) * up[i];
}

extern "C" __global__ void add(float* x, const float* y, int n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)n) x[i] += y[i];
}

__device__ __forceinline__ float uniform(u64 seed, u64 step, u64 i) {
    u64 z = seed ^ (step * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((float)(z >> 40) + 0.5f) / 16777216.f;
}

// Greedy or Gumbel-max sampling; one block of 1024 threads; ties to the lowest index.
extern "C" __global__ void __launch_bounds__(1024) sample(const float* logits, int vocab, float temperature, u64 seed, u64 step, unsigned* out) {
    __shared__ float bs[1024];
    __shared__ int bi[1024];
    float best = -KVD_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float s = temperature <= 0.f ? logits[i] : logits[i] / temperature - logf(-logf(uniform(seed, step, (u64)i)));
        if (s > best) { best = s; idx = i; }
    }
    bs[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            float s2 = bs[threadIdx.x + o];
            int i2 = bi[threadIdx.x + o];
            if (s2 > bs[threadIdx.x] || (s2 == bs[threadIdx.x] && i2 < bi[threadIdx.x])) {
                bs[threadIdx.x] = s2;
                bi[threadIdx.x] = i2;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = bi[0] == 0x7fffffff ? 0 : bi[0];
}

// Moving KV between the paged cache and transfer blocks is row copies: a row is `n`
// floats contiguous on both sides (the heads h0..h0+hs of one token of one layer and
// part). One warp per row, grid-stride over rows; the row's place is worked out once per
// row (divisions per row, not per element), then its lanes move it in 16-byte accesses
// when both ends are 16-byte aligned and n is a multiple of 4 (any head_dim that is a
// multiple of 4, with cudaMalloc'd or page-aligned buffers), else float by float.
__device__ __forceinline__ void copy_row(const float* __restrict__ s, float* __restrict__ d, int n, int lane) {
    if ((((size_t)s | (size_t)d) & 15) == 0 && (n & 3) == 0) {
        const float4* s4 = (const float4*)s;
        float4* d4 = (float4*)d;
        for (int i = lane; i < n / 4; i += 32) d4[i] = s4[i];
    } else {
        for (int i = lane; i < n; i += 32) d[i] = s[i];
    }
}

__device__ __forceinline__ size_t warp_id() { return ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ size_t warp_count() { return ((size_t)gridDim.x * blockDim.x) >> 5; }

// Row r of the transfer blocks [block b][layer][part][token] (rows of hs*hd floats): its
// place in transfer block b and in the paged cache.
// `lps`: layers × parts per layer (2 for K and V, 1 for a latent); row `lp` of a block is
// layer `lp / parts`, part `lp % parts`, which lie at `lp` in the cache's order either way.
__device__ __forceinline__ void transfer_row(size_t r, const unsigned* blocks, int lps, int num_blocks, int bt,
                                             int kvh, int hd, int h0, int hs, int* b, size_t* cache_at,
                                             size_t* block_at) {
    int t = r % bt;
    size_t q = r / bt;
    int lp = q % lps;
    *b = q / lps;
    *cache_at = ((((size_t)lp * num_blocks + blocks[*b]) * bt + t) * kvh + h0) * hd;
    *block_at = ((size_t)lp * bt + t) * hs * hd;
}

// Paged blocks -> transfer blocks, one destination pointer per block (device memory or a
// mapped, registered host pool).
extern "C" __global__ void gather(const float* cache, const unsigned* blocks, const u64* dst, int nblocks, int lps,
                                  int num_blocks, int bt, int kvh, int hd, int h0, int hs) {
    const size_t rows = (size_t)nblocks * lps * bt;
    const int lane = threadIdx.x & 31;
    for (size_t r = warp_id(); r < rows; r += warp_count()) {
        int b;
        size_t c, o;
        transfer_row(r, blocks, lps, num_blocks, bt, kvh, hd, h0, hs, &b, &c, &o);
        copy_row(cache + c, (float*)dst[b] + o, hs * hd, lane);
    }
}

// Transfer blocks -> paged blocks (the inverse of gather).
extern "C" __global__ void scatter(float* cache, const unsigned* blocks, const u64* src, int nblocks, int lps,
                                   int num_blocks, int bt, int kvh, int hd, int h0, int hs) {
    const size_t rows = (size_t)nblocks * lps * bt;
    const int lane = threadIdx.x & 31;
    for (size_t r = warp_id(); r < rows; r += warp_count()) {
        int b;
        size_t c, o;
        transfer_row(r, blocks, lps, num_blocks, bt, kvh, hd, h0, hs, &b, &c, &o);
        copy_row((const float*)src[b] + o, cache + c, hs * hd, lane);
    }
}

// Re-slices n logical blocks from src_tp shards ([block][rank] pointers) to dst_tp shards.
// A row is one head of one token of one layer and part (hd floats): the shards it comes
// from and goes to are worked out per row.
extern "C" __global__ void reslice(const u64* src, const u64* dst, int n, int lps, int bt, int kvh, int hd,
                                   int src_tp, int dst_tp) {
    const size_t per = (size_t)lps * bt;  // rows of heads per block
    const size_t rows = (size_t)n * per * kvh;
    const int lane = threadIdx.x & 31;
    const int hs_in = kvh / src_tp, hs_out = kvh / dst_tp;
    for (size_t r = warp_id(); r < rows; r += warp_count()) {
        int h = r % kvh;
        size_t q = r / kvh;
        size_t row = q % per;
        size_t b = q / per;
        const float* s = (const float*)src[b * src_tp + h / hs_in] + (row * hs_in + h % hs_in) * hd;
        float* o = (float*)dst[b * dst_tp + h / hs_out] + (row * hs_out + h % hs_out) * hd;
        copy_row(s, o, hd, lane);
    }
}
