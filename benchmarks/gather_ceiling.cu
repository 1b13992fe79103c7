// Gather-ceiling microbenchmark kernels for the MSDA access pattern (see gather_ceiling.py).
//
// Load-only kernels: each fetches the bilinear footprint of every sample (2x2 pixels x D=32 fp16 = 256 B)
// of a 4-level value tensor laid out (N, S, M, D), levels concatenated along S, and XOR-reduces the loaded
// 32-bit words so nothing is optimised away. All methods must produce the same XOR.
//
// Samples are ordered (n, q, m, l, p) as the real kernels visit them. Each sample's corner coordinates are
// precomputed on the host side as one packed uint32: x0 in the low 16 bits, y0 in the high 16 bits (signed),
// x0 = floor(x*W - 0.5), y0 = floor(y*H - 0.5), clamped to [-1, W-1] x [-1, H-1]. Corners outside the level
// are zero (skipped by LDG, zero-filled by TMA), as in the real kernel.
//
// Methods:
//   ldg_kernel : 16-byte __ldg gathers through L1. A warp covers 32/TPQ consecutive queries of one head,
//                TPQ threads per query; each thread loads 16/TPQ corners x one 16-byte channel chunk per sample.
//                HP=1 (head pairs): a warp covers 16/TPQ queries of two heads (2k, 2k+1), the TPQ threads of
//                a query's head 2k next to those of its head 2k+1, so the 64-byte rows that one 128-byte
//                wavefront carries lie in both halves of their lines (one head's rows all lie in the same
//                half: the same L1 banks).
//                A corner outside the level loads the clamped pixel and is masked to zero (unpredicated loads
//                let ptxas keep more loads in flight than `if (inside) v = load`).
//                BK>0 (bulk): each warp item also reads its even share of a contiguous buffer (the bytes a real
//                kernel reads in bulk: the staged levels whole, its inputs) and writes its share of an output
//                buffer, streaming. BK=1: the reads after the item's gathers; BK=2: a lane's first four words
//                issued before them; BK=3: one lane copies the share into shared memory with 1-d TMA bulk copies
//                (the first issued before the gathers), which the warp XORs out after them.
//   tma_kernel : warp-specialised; NPROD producer warps issue one cp.async.bulk.tensor.5d box [32,1,2,2,1]
//                per sample (one box per lane) into a ring of STAGES rounds of B boxes guarded by
//                full/empty mbarriers; consumer warps XOR the boxes out of shared memory.
//                With NSTG > 0 the NSTG coarsest levels of one (image, head) are staged whole in shared
//                memory (plain 16-byte loads) and gathered with ld.shared; only the fine levels go by TMA.
//
// Host API is plain C (ctypes), no torch headers needed. Build:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -shared -o libgc.so gather_ceiling.cu
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

constexpr int L = 4;         // levels (all presets here have 4)
constexpr int MAX_STAGES = 16;

struct Levels {
  int H[L], W[L], start[L];
};
struct Maps {
  CUtensorMap m[L];
};

__device__ __forceinline__ int coord_x(uint32_t c) { return (int)(int16_t)(c & 0xffffu); }
__device__ __forceinline__ int coord_y(uint32_t c) { return ((int)c) >> 16; }
__device__ __forceinline__ uint32_t xor4(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
// one word per warp: out[global warp index] = XOR over the warp's lanes (all lanes must call it)
__device__ __forceinline__ void write_warp_xor(uint32_t* out, uint32_t acc) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) out[((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5] = acc;
}

// select a[i] for a small array with a run-time index, without local memory
template <int K>
__device__ __forceinline__ int sel(const int (&a)[K], int i) {
  int r = a[0];
#pragma unroll
  for (int k = 1; k < K; ++k)
    if (i == k) r = a[k];
  return r;
}

// mbarriers and TMA copies (the LDG kernel's bulk form 3 and the TMA kernels)
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint32_t a, int cnt) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(cnt) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t a, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t a, uint32_t parity) {
  long long t0 = 0;
  for (;;) {
    uint32_t done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
    if (done) return;
    // watchdog: a lost phase would hang the benchmark; trap after ~4e9 cycles instead
    if (t0 == 0) t0 = clock64();
    else if (clock64() - t0 > (1ll << 32)) __trap();
  }
}
__device__ __forceinline__ void tma_box(uint32_t dst, const void* map, int c0, int c1, int c2, int c3, int c4,
                                        uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
// 1-d bulk copy global -> shared, completing on an mbarrier (size a multiple of 16 B, both ends 16 B aligned)
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// ------------------------------------------------------------------------------------------------------------
// (a) LDG
// ------------------------------------------------------------------------------------------------------------
// K packed coordinates (K a multiple of 4, contiguous and 16-byte aligned) as 16-byte vectors
template <int K>
__device__ __forceinline__ void load_coords(uint32_t (&cc)[K], const uint4* cp) {
#pragma unroll
  for (int i = 0; i < K / 4; ++i) {
    const uint4 c4 = __ldg(cp + i);
    cc[4 * i] = c4.x; cc[4 * i + 1] = c4.y; cc[4 * i + 2] = c4.z; cc[4 * i + 3] = c4.w;
  }
}
// The first AHEAD words (0 or more) of a lane's share [lo, hi) of the bulk, issued before the item's gathers ...
template <int AHEAD>
__device__ __forceinline__ void bulk_ahead(uint4* ahead, const uint4* __restrict__ bulk, long lo, long hi, int lane) {
#pragma unroll
  for (int k = 0; k < AHEAD; ++k) {
    const long w = lo + lane + 32 * k;
    ahead[k] = w < hi ? __ldcs(bulk + w) : make_uint4(0, 0, 0, 0);
  }
}
// ... and the rest of the share after them, all XORed into acc
template <int AHEAD>
__device__ __forceinline__ uint32_t bulk_rest(uint32_t acc, const uint4* ahead, const uint4* __restrict__ bulk, long lo,
                                              long hi, int lane) {
#pragma unroll
  for (int k = 0; k < AHEAD; ++k) acc ^= xor4(ahead[k]);
#pragma unroll 4
  for (long w = lo + lane + 32 * AHEAD; w < hi; w += 32) acc ^= xor4(__ldcs(bulk + w));
  return acc;
}
// An item's share of the output-sized sink, written (streaming) with the warp's running XOR
__device__ __forceinline__ void store_sink(uint4* __restrict__ sink, long sink_words, long sink_share, long item,
                                           int lane, uint32_t acc) {
  const long s_lo = min(item * sink_share, sink_words), s_hi = min(s_lo + sink_share, sink_words);
  for (long w = s_lo + lane; w < s_hi; w += 32) __stcs(sink + w, make_uint4(acc, (uint32_t)w, 0u, 0u));
}
// One level's P samples of one (image, query, head), this thread's corners XORed into acc: loads in batches of UU
// samples, each unpredicated from the clamped pixel and zeroed afterwards if the corner is outside, so that the
// compiler keeps all of a batch's loads in flight. vb: the level's first pixel row at this thread's 16 bytes; cc: the
// level's P packed coordinates; ps: the pixel stride in uint4.
template <int P, int TPQ, int UU>
__device__ __forceinline__ uint32_t gather_level(const uint4* __restrict__ vb, const uint32_t* cc, int H, int W,
                                                 int ps, int c0, uint32_t acc) {
  constexpr int CPT = 16 / TPQ;     // corners per thread per sample
  constexpr int CSTEP = TPQ / 4;    // corner stride between a thread's corners
#pragma unroll
  for (int p0 = 0; p0 < P; p0 += UU) {
    uint4 v[UU][CPT];
    uint32_t okm[UU][CPT];
#pragma unroll
    for (int u = 0; u < UU; ++u) {
      const uint32_t c = cc[p0 + u];
      const int x0 = coord_x(c), y0 = coord_y(c);
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int corner = c0 + k * CSTEP;
        const int y = y0 + (corner >> 1), x = x0 + (corner & 1);
        const bool ok = (unsigned)y < (unsigned)H && (unsigned)x < (unsigned)W;
        const int yc = min(max(y, 0), H - 1), xc = min(max(x, 0), W - 1);
        okm[u][k] = ok ? 0xffffffffu : 0u;
        v[u][k] = __ldg(vb + (yc * W + xc) * ps);
      }
    }
#pragma unroll
    for (int u = 0; u < UU; ++u)
#pragma unroll
      for (int k = 0; k < CPT; ++k) acc ^= xor4(v[u][k]) & okm[u][k];
  }
  return acc;
}

// Warp item = (n, query tile of QW queries, m), m fastest; a block of 8 warps takes 8 consecutive warp items
// (block item). contig=0: block items are spread over blocks grid-stride (neighbouring blocks run
// neighbouring queries, like a non-persistent launch); contig=1: each block takes a contiguous slice.
template <int P, int TPQ, int U, int HP, int BK>
__global__ void __launch_bounds__(256) ldg_kernel(const uint4* __restrict__ value, const uint32_t* __restrict__ coords,
                                                  Levels lv, int N, int Lq, int M, int S, int contig,
                                                  int gather_levels, const uint4* __restrict__ bulk, long bulk_words,
                                                  uint4* __restrict__ sink, long sink_words,
                                                  uint32_t* __restrict__ out) {
  constexpr int HPW = HP ? 2 : 1;        // heads per warp
  constexpr int QW = 32 / TPQ / HPW;     // queries per warp
  constexpr int UU = U < P ? U : P;      // samples whose loads are issued together
  static_assert(P % UU == 0, "U must divide P");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wpb = blockDim.x >> 5;
  const int qi = lane / (TPQ * HPW), hh = (lane / TPQ) % HPW, t = lane % TPQ, ch = t & 3, c0 = t >> 2;
  const int nqt = (Lq + QW - 1) / QW;
  const int MI = (M + HPW - 1) / HPW;    // head items
  const long total_items = (long)N * nqt * MI;
  const long total_bitems = (total_items + wpb - 1) / wpb;
  long b_begin, b_end, b_step;
  if (contig) {
    b_begin = total_bitems * blockIdx.x / gridDim.x;
    b_end = total_bitems * (blockIdx.x + 1) / gridDim.x;
    b_step = 1;
  } else {
    b_begin = blockIdx.x;
    b_end = total_bitems;
    b_step = gridDim.x;
  }
  const int ps = M * 4;  // pixel stride in uint4
  uint32_t acc = 0;
  constexpr int SCRATCH = 128;  // uint4 words of one warp's shared-memory chunk (BK=3)
  __shared__ __align__(128) uint4 scratch[BK == 3 ? 8 * SCRATCH : 1];
  __shared__ __align__(8) uint64_t bulk_bar[BK == 3 ? 8 : 1];
  uint32_t bulk_phase = 0;
  if constexpr (BK == 3) {
    if (lane == 0) {
      mbar_init(smem_u32(&bulk_bar[warp]), 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
  }
  // BK=3: one lane copies words [w, w + n) of bulk into this warp's chunk of shared memory
  auto copy_chunk = [&](long w, long n) {
    if (lane == 0) {
      const uint32_t bar = smem_u32(&bulk_bar[warp]);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the warp's reads of the last chunk first
      mbar_arrive_expect_tx(bar, (uint32_t)n * 16u);
      bulk_copy(smem_u32(&scratch[warp * SCRATCH]), bulk + w, (uint32_t)n * 16u, bar);
    }
  };
  auto xor_chunk = [&](long n) {
    mbar_wait(smem_u32(&bulk_bar[warp]), bulk_phase);
    bulk_phase ^= 1;
    for (int k = lane; k < n; k += 32) acc ^= xor4(scratch[warp * SCRATCH + k]);
    __syncwarp();
  };
  // each item's share of the bulk words (the last items' shorter or empty): no division in the item loop
  const long bulk_share = (bulk_words + total_items - 1) / total_items;
  const long sink_share = (sink_words + total_items - 1) / total_items;
  for (long bi = b_begin; bi < b_end; bi += b_step) {
    const long item = bi * wpb + warp;
    if (item >= total_items) continue;
    constexpr int AHEAD = BK == 2 ? 4 : 0;  // bulk words a lane keeps in flight across the item's gathers
    uint4 ahead[AHEAD > 0 ? AHEAD : 1];
    long bulk_lo = 0, bulk_hi = 0;
    if constexpr (BK > 0) {  // this item's share of the bulk reads
      bulk_lo = min(item * bulk_share, bulk_words);
      bulk_hi = min(bulk_lo + bulk_share, bulk_words);
      bulk_ahead<AHEAD>(ahead, bulk, bulk_lo, bulk_hi, lane);
      if constexpr (BK == 3) {
        if (bulk_hi > bulk_lo) copy_chunk(bulk_lo, min(bulk_hi - bulk_lo, (long)SCRATCH));
      }
    }
    const int m = (int)(item % MI) * HPW + hh;
    const long r = item / MI;
    const int qt = (int)(r % nqt);
    const int n = (int)(r / nqt);
    const int q = qt * QW + qi;
    if (q < Lq && m < M) {
      const uint32_t* cp = coords + (((long)n * Lq + q) * M + m) * (L * P);
      // all L*P packed coordinates of this (n, q, m) are contiguous: read them as 16-byte vectors up front
      uint32_t cc[L * P];
      load_coords(cc, reinterpret_cast<const uint4*>(cp));
#pragma unroll
      for (int l = 0; l < L; ++l) {
        if (l >= gather_levels) break;  // the levels a kernel would stage: no loads at all
        const int H = lv.H[l], W = lv.W[l];
        const uint4* vb = value + (((long)n * S + lv.start[l]) * M + m) * 4 + ch;
        acc = gather_level<P, TPQ, UU>(vb, cc + l * P, H, W, ps, c0, acc);
      }
    }
    if constexpr (BK > 0) {
      if constexpr (BK == 3) {
        for (long w = bulk_lo; w < bulk_hi; w += SCRATCH) {
          if (w > bulk_lo) copy_chunk(w, min(bulk_hi - w, (long)SCRATCH));
          xor_chunk(min(bulk_hi - w, (long)SCRATCH));
        }
      } else {
        acc = bulk_rest<AHEAD>(acc, ahead, bulk, bulk_lo, bulk_hi, lane);
      }
      store_sink(sink, sink_words, sink_share, item, lane, acc);
    }
  }
  write_warp_xor(out, acc);
}

// The LDG kernel's contiguous blocks (contig=1), their items gathered level by level: every item's level a,
// then every item's level b, ..., so that a level's rows are read again within one pass rather than across the
// whole launch. order 2: levels in order; 3: levels 1, 0, 2, ...; 4: even images take order 2, odd ones 3;
// 5: rotated by the image (level (pass + n) % levels first). The bulk words and the sink in the first pass.
// One head a warp, P a multiple of 4.
template <int P, int TPQ, int U, int BK>
__global__ void __launch_bounds__(256, TPQ == 16 ? 3 : 2) ldg_level_kernel(
    const uint4* __restrict__ value, const uint32_t* __restrict__ coords, Levels lv, int N, int Lq, int M, int S,
    int order, int gather_levels, const uint4* __restrict__ bulk, long bulk_words, uint4* __restrict__ sink,
    long sink_words, uint32_t* __restrict__ out) {
  static_assert(BK == 0 || BK == 2, "bulk forms 0 and 2 only");
  static_assert(P % 4 == 0, "P a multiple of 4");
  constexpr int QW = 32 / TPQ, UU = U < P ? U : P;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wpb = blockDim.x >> 5;
  const int qi = lane / TPQ, t = lane % TPQ, ch = t & 3, c0 = t >> 2;
  const int nqt = (Lq + QW - 1) / QW;
  const long total_items = (long)N * nqt * M;
  const long total_bitems = (total_items + wpb - 1) / wpb;
  const long b_begin = total_bitems * blockIdx.x / gridDim.x, b_end = total_bitems * (blockIdx.x + 1) / gridDim.x;
  const int ps = M * 4;
  const int gl = gather_levels < L ? gather_levels : L;
  const long bulk_share = (bulk_words + total_items - 1) / total_items;
  const long sink_share = (sink_words + total_items - 1) / total_items;
  uint32_t acc = 0;
  const int passes = gl > 0 ? gl : 1;  // no level gathered (--bulk-only): one pass for the bulk alone
  for (int pass = 0; pass < passes; ++pass) {
    for (long bi = b_begin; bi < b_end; ++bi) {
      const long item = bi * wpb + warp;
      if (item >= total_items) continue;
      constexpr int AHEAD = BK == 2 ? 4 : 0;
      uint4 ahead[AHEAD > 0 ? AHEAD : 1];
      long bulk_lo = 0, bulk_hi = 0;
      if (BK > 0 && pass == 0) {
        bulk_lo = min(item * bulk_share, bulk_words);
        bulk_hi = min(bulk_lo + bulk_share, bulk_words);
        bulk_ahead<AHEAD>(ahead, bulk, bulk_lo, bulk_hi, lane);
      }
      const int m = (int)(item % M);
      const long r = item / M;
      const int qt = (int)(r % nqt);
      const int n = (int)(r / nqt);
      const int q = qt * QW + qi;
      const int o = order == 4 ? 2 + (n & 1) : order;
      const int l = o == 2 ? pass : o == 3 ? (pass < 2 && gl >= 2 ? 1 - pass : pass) : (pass + n) % passes;
      if (q < Lq && gl > 0) {
        const uint4* cp = reinterpret_cast<const uint4*>(coords + ((((long)n * Lq + q) * M + m) * L + l) * P);
        uint32_t cc[P];
        load_coords(cc, cp);
        const int H = sel(lv.H, l), W = sel(lv.W, l);
        const uint4* vb = value + (((long)n * S + sel(lv.start, l)) * M + m) * 4 + ch;
        acc = gather_level<P, TPQ, UU>(vb, cc, H, W, ps, c0, acc);
      }
      if (BK > 0 && pass == 0) {
        acc = bulk_rest<AHEAD>(acc, ahead, bulk, bulk_lo, bulk_hi, lane);
        store_sink(sink, sink_words, sink_share, item, lane, acc);
      }
    }
  }
  write_warp_xor(out, acc);
}

// ------------------------------------------------------------------------------------------------------------
// (b)/(c) TMA, warp-specialised
// ------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 lds16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts16(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// A round = up to QR items (= (n, q, m) triples) and their NF*P fine-level boxes.
// ORDER 0: items in natural (n, q, m) order, rounds dealt to CTAs round-robin.
// ORDER 1: items in head-major (n, m, q) order, rounds never straddle an (n, m); each CTA takes a contiguous
//          slice of rounds (needed for NSTG > 0: the CTA restages only when (n, m) changes).
template <int P, int NF, int B, int ORDER>
struct Rounds {
  static constexpr int QR = B / (NF * P);
  static_assert(QR >= 1 && QR * NF * P == B, "B must be a multiple of NF*P");
  long total_items, total_rounds, r0, nr;
  int N, Lq, M, rpn;
  __device__ Rounds(int N_, int Lq_, int M_) : N(N_), Lq(Lq_), M(M_) {
    total_items = (long)N * Lq * M;
    const long G = gridDim.x;
    if (ORDER == 0) {
      total_rounds = (total_items + QR - 1) / QR;
      r0 = blockIdx.x;
      nr = total_rounds > (long)blockIdx.x ? (total_rounds - blockIdx.x + G - 1) / G : 0;
      rpn = 0;
    } else {
      rpn = (Lq + QR - 1) / QR;
      total_rounds = (long)N * M * rpn;
      r0 = total_rounds * blockIdx.x / G;
      nr = total_rounds * (blockIdx.x + 1) / G - r0;
    }
  }
  __device__ long id(long k) const { return ORDER == 0 ? r0 + k * (long)gridDim.x : r0 + k; }
  // number of items in round R
  __device__ int count(long R) const {
    if (ORDER == 0) {
      const long rem = total_items - R * QR;
      return rem < QR ? (int)rem : QR;
    } else {
      const int q0 = (int)(R % rpn) * QR;
      return Lq - q0 < QR ? Lq - q0 : QR;
    }
  }
  __device__ long nm_of(long R) const { return ORDER == 0 ? -1 : R / rpn; }
  // item j of round R -> (n, m, flat item index I = (n*Lq + q)*M + m)
  __device__ void item(long R, int j, int& n, int& m, long& I) const {
    if (ORDER == 0) {
      I = R * QR + j;
      m = (int)(I % M);
      n = (int)(I / ((long)Lq * M));
    } else {
      const long nm = R / rpn;
      const int q = (int)(R % rpn) * QR + j;
      n = (int)(nm / M);
      m = (int)(nm % M);
      I = ((long)n * Lq + q) * M + m;
    }
  }
};

// Bytes of one ring slot: B boxes, plus (NSTG > 0) the packed coordinates of the round's coarse samples,
// bulk-copied by the producer next to the boxes so that consumers never wait on global memory.
__host__ __device__ constexpr int coarse_coord_bytes(int P, int NSTG, int B) {
  return NSTG == 0 ? 0 : (((B / ((L - NSTG) * P)) * NSTG * P * 4 + 127) / 128) * 128;
}
__host__ __device__ constexpr int slot_bytes(int P, int NSTG, int B) { return B * 256 + coarse_coord_bytes(P, NSTG, B); }

template <int P, int NSTG, int B, int ORDER>
__global__ void __launch_bounds__(1024) tma_kernel(const __grid_constant__ Maps maps, const uint4* __restrict__ value,
                                                  const uint32_t* __restrict__ coords, Levels lv, int N, int Lq,
                                                  int M, int S, int stages, int nprod, uint32_t* __restrict__ out) {
  constexpr int NF = L - NSTG;
  static_assert(NSTG == 0 || ORDER == 1, "staging needs head-major order");
  constexpr int BPL = B / 32;  // boxes per producer lane per round
  constexpr int SLOT = slot_bytes(P, NSTG, B);
  constexpr int CCB = NSTG * P * 4;  // bytes of one item's coarse coordinates (contiguous in global memory)
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t full_bar[MAX_STAGES], empty_bar[MAX_STAGES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ncw = (blockDim.x >> 5) - nprod;
  const uint32_t ring = smem_u32(smem);
  const uint32_t staged = ring + (uint32_t)stages * SLOT;
  Rounds<P, NF, B, ORDER> rd(N, Lq, M);

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_u32(&full_bar[s]), 1);
      mbar_init(smem_u32(&empty_bar[s]), ncw);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  uint32_t acc = 0;
  if (warp < nprod) {
    // ---------------- producer warps: round k goes to producer warp k % nprod ----------------
    for (long k = warp; k < rd.nr; k += nprod) {
      const int st = (int)(k % stages);
      const uint32_t ph = (uint32_t)((k / stages) & 1);
      const long R = rd.id(k);
      const int nbox = rd.count(R) * NF * P;
      // read this round's coordinates before waiting for the slot
      uint32_t c[BPL];
      int bn[BPL], bm[BPL], blf[BPL];
#pragma unroll
      for (int b = 0; b < BPL; ++b) {
        const int i = lane + 32 * b;
        c[b] = 0; bn[b] = 0; bm[b] = 0; blf[b] = 0;
        if (i < nbox) {
          const int j = i / (NF * P), rr = i % (NF * P), lf = rr / P, p = rr % P;
          long I;
          rd.item(R, j, bn[b], bm[b], I);
          blf[b] = lf;
          c[b] = __ldg(coords + I * (L * P) + lf * P + p);
        }
      }
      const int cnt = rd.count(R);
      if (k >= stages) mbar_wait(smem_u32(&empty_bar[st]), ph ^ 1);
      if (lane == 0) mbar_arrive_expect_tx(smem_u32(&full_bar[st]), (uint32_t)nbox * 256u + (uint32_t)(cnt * CCB));
      __syncwarp();
      if constexpr (NSTG > 0) {
        if (lane < cnt) {
          int n, m;
          long I;
          rd.item(R, lane, n, m, I);
          bulk_copy(ring + (uint32_t)st * SLOT + B * 256 + lane * CCB, coords + I * (L * P) + NF * P, CCB,
                    smem_u32(&full_bar[st]));
        }
      }
#pragma unroll
      for (int b = 0; b < BPL; ++b) {
        const int i = lane + 32 * b;
        if (i < nbox) {
          const char* map = reinterpret_cast<const char*>(&maps) + blf[b] * sizeof(CUtensorMap);
          tma_box(ring + (uint32_t)st * SLOT + (uint32_t)i * 256u, map, 0, bm[b], coord_x(c[b]), coord_y(c[b]), bn[b],
                  smem_u32(&full_bar[st]));
        }
      }
    }
  } else {
    // ---------------- consumer warps ----------------
    const int ct = threadIdx.x - nprod * 32, nct = ncw * 32;
    long cur_nm = -1;
    int sH[NSTG > 0 ? NSTG : 1], sW[NSTG > 0 ? NSTG : 1], soff[NSTG > 0 ? NSTG : 1];
    {
      int off = 0;
#pragma unroll
      for (int s = 0; s < NSTG; ++s) {
        sH[s] = lv.H[NF + s];
        sW[s] = lv.W[NF + s];
        soff[s] = off;
        off += sH[s] * sW[s];
      }
    }
    for (long k = 0; k < rd.nr; ++k) {
      const int st = (int)(k % stages);
      const uint32_t ph = (uint32_t)((k / stages) & 1);
      const long R = rd.id(k);
      const int cnt = rd.count(R);
      if constexpr (NSTG > 0) {
        const long nm = rd.nm_of(R);
        if (nm != cur_nm) {
          // restage the coarse levels of (n, m)
          asm volatile("bar.sync 1, %0;" ::"r"(nct) : "memory");
          const int n = (int)(nm / M), m = (int)(nm % M);
#pragma unroll
          for (int s = 0; s < NSTG; ++s) {
            const int npx = sH[s] * sW[s];
            const uint4* src = value + (((long)n * S + lv.start[NF + s]) * M + m) * 4;
            for (int i = ct; i < npx * 4; i += nct) {
              const int px = i >> 2, chk = i & 3;
              sts16(staged + (uint32_t)(soff[s] + px) * 64u + chk * 16, __ldg(src + (long)px * M * 4 + chk));
            }
          }
          asm volatile("bar.sync 1, %0;" ::"r"(nct) : "memory");
          cur_nm = nm;
        }
      }
      mbar_wait(smem_u32(&full_bar[st]), ph);
      const uint32_t base = ring + (uint32_t)st * SLOT;
      if constexpr (NSTG > 0) {
        // coarse samples of this round from the staged levels: 4 threads per sample, each one 16-byte channel
        // chunk of the 4 corners; the coordinates sit in the slot, [item][coarse level][point]
        const int ntask = cnt * NSTG * P * 4;
        for (int t = ct; t < ntask; t += nct) {
          const int sc = t >> 2, chk = t & 3;
          const int lc = (sc / P) % NSTG;
          const uint32_t c = lds32(base + B * 256 + sc * 4);
          const int H = sel(sH, lc), W = sel(sW, lc), off = sel(soff, lc);
          const int x0 = coord_x(c), y0 = coord_y(c);
#pragma unroll
          for (int corner = 0; corner < 4; ++corner) {
            const int y = y0 + (corner >> 1), x = x0 + (corner & 1);
            if ((unsigned)y < (unsigned)H && (unsigned)x < (unsigned)W)
              acc ^= xor4(lds16(staged + (uint32_t)(off + y * W + x) * 64u + chk * 16));
          }
        }
      }
      // fine-level boxes of this round from the TMA ring
      const int nv = cnt * NF * P * 16;  // uint4 words in this round
      for (int i = ct; i < nv; i += nct) acc ^= xor4(lds16(base + (uint32_t)i * 16u));
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_u32(&empty_bar[st]));
    }
  }
  write_warp_xor(out, acc);
}

// ------------------------------------------------------------------------------------------------------------
// host API
// ------------------------------------------------------------------------------------------------------------
// geom: N, Lq, M, S, H[4], W[4], start[4]
static Levels levels_of(const int* g) {
  Levels lv;
  for (int l = 0; l < L; ++l) {
    lv.H[l] = g[4 + l];
    lv.W[l] = g[8 + l];
    lv.start[l] = g[12 + l];
  }
  return lv;
}

// bk: the kernel's bulk form (0: no bulk work); 4 + bulk form: the level-pass kernel (contig = its order)
static const void* ldg_fn(int P, int tpq, int u, int hp, int bk) {
#define GC_LDG(p, t, uu, h)                                                                                  \
  if (P == p && tpq == t && u == uu && hp == h) {                                                            \
    const void* forms[4] = {(const void*)ldg_kernel<p, t, uu, h, 0>, (const void*)ldg_kernel<p, t, uu, h, 1>, \
                            (const void*)ldg_kernel<p, t, uu, h, 2>, (const void*)ldg_kernel<p, t, uu, h, 3>}; \
    if (bk >= 0 && bk < 4) return forms[bk];                                                                 \
    if (h == 0 && (p % 4) == 0 && bk == 4) return (const void*)ldg_level_kernel<p, t, uu, 0>;                \
    if (h == 0 && (p % 4) == 0 && bk == 6) return (const void*)ldg_level_kernel<p, t, uu, 2>;                \
    return nullptr;                                                                                          \
  }
  GC_LDG(4, 4, 2, 0) GC_LDG(4, 4, 4, 0) GC_LDG(4, 8, 4, 0) GC_LDG(4, 16, 4, 0)
  GC_LDG(8, 4, 2, 0) GC_LDG(8, 4, 4, 0) GC_LDG(8, 8, 4, 0) GC_LDG(8, 16, 4, 0) GC_LDG(8, 16, 8, 0)
  GC_LDG(4, 4, 2, 1) GC_LDG(4, 4, 4, 1) GC_LDG(8, 4, 2, 1) GC_LDG(8, 4, 4, 1)
#undef GC_LDG
  return nullptr;
}

static const void* tma_fn(int P, int nstg, int B, int order) {
#define GC_TMA(p, s, b, o) \
  if (P == p && nstg == s && B == b && order == o) return (const void*)tma_kernel<p, s, b, o>;
  GC_TMA(4, 0, 32, 0) GC_TMA(4, 0, 64, 0) GC_TMA(4, 0, 32, 1) GC_TMA(4, 0, 64, 1)
  GC_TMA(4, 2, 32, 1) GC_TMA(4, 2, 64, 1)
  GC_TMA(8, 0, 32, 0) GC_TMA(8, 0, 64, 0) GC_TMA(8, 0, 32, 1) GC_TMA(8, 0, 64, 1)
  GC_TMA(8, 2, 32, 1) GC_TMA(8, 2, 64, 1)
#undef GC_TMA
  return nullptr;
}

extern "C" {

int gc_last_error() { return (int)cudaGetLastError(); }
const char* gc_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

// Encode the per-level tensor maps over value (N, S, M, 32) fp16 into maps_out (L * 128 bytes, host memory):
// level l is the 5-d tensor (D=32, M, W_l, H_l, N) starting at pixel start_l, box [32, 1, 2, 2, 1].
int gc_encode_maps(void* maps_out, const void* value, const int* g) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&encode, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return -1;
  }
  const int N = g[0], M = g[2], S = g[3];
  Levels lv = levels_of(g);
  Maps local;  // the driver wants a 64-byte aligned CUtensorMap: encode here, copy out
  Maps* maps = &local;
  for (int l = 0; l < L; ++l) {
    cuuint64_t dims[5] = {32, (cuuint64_t)M, (cuuint64_t)lv.W[l], (cuuint64_t)lv.H[l], (cuuint64_t)N};
    cuuint64_t strides[4] = {64, (cuuint64_t)M * 64, (cuuint64_t)lv.W[l] * M * 64, (cuuint64_t)S * M * 64};
    cuuint32_t box[5] = {32, 1, 2, 2, 1}, es[5] = {1, 1, 1, 1, 1};
    void* base = (void*)((const char*)value + (size_t)lv.start[l] * M * 64);
    CUresult r = encode(&maps->m[l], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5, base, dims, strides, box, es,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return 1000 + (int)r;
  }
  memcpy(maps_out, &local, sizeof(Maps));
  return 0;
}

// an LDG kernel with its carveout set, the same for the occupancy query and the launch: all of it as L1, but for
// the TMA bulk form's 16 KB a block of shared memory (nullptr if the variant is missing)
static const void* ldg_kernel_for(int P, int tpq, int u, int hp, int bk) {
  const void* f = ldg_fn(P, tpq, u, hp, bk);
  if (f) cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, bk == 3 ? 50 : 0);  // 4+: no smem
  return f;
}

// blocks of 256 threads; returns the max resident blocks per SM through occ (or <0 if the variant is missing)
int gc_ldg_occupancy(int P, int tpq, int u, int hp, int bk, int* occ) {
  const void* f = ldg_kernel_for(P, tpq, u, hp, bk);
  if (!f) return -2;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, f, 256, 0);
}

int gc_ldg(const void* value, const void* coords, const int* g, int P, int tpq, int u, int hp, int bk, int contig,
           int grid, int gather_levels, const void* bulk, long long bulk_words, void* sink, long long sink_words,
           void* out, void* stream) {
  const void* f = ldg_kernel_for(P, tpq, u, hp, bk);
  long bw = (long)bulk_words, sw = (long)sink_words;
  if (!f) return -2;
  Levels lv = levels_of(g);
  int N = g[0], Lq = g[1], M = g[2], S = g[3];
  void* args[] = {(void*)&value, (void*)&coords, (void*)&lv, &N,   &Lq, &M,    &S,
                  &contig,        &gather_levels,  (void*)&bulk, &bw, &sink, &sw, &out};
  cudaError_t e = cudaLaunchKernel(f, dim3(grid), dim3(256), args, 0, (cudaStream_t)stream);
  return (int)e;
}

static size_t tma_smem(int P, int nstg, int B, int stages, int staged_px) {
  return (size_t)stages * slot_bytes(P, nstg, B) + (size_t)staged_px * 64;
}

int gc_tma_occupancy(int P, int nstg, int B, int order, int stages, int nprod, int ncons, int staged_px, int* occ) {
  const void* f = tma_fn(P, nstg, B, order);
  if (!f || stages > MAX_STAGES) return -2;
  size_t sm = tma_smem(P, nstg, B, stages, staged_px);
  cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
  if (e != cudaSuccess) { cudaGetLastError(); *occ = 0; return 0; }
  cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, f, 32 * (nprod + ncons), sm);
}

int gc_tma(const void* maps_host, const void* value, const void* coords, const int* g, int P, int nstg, int B,
           int order, int stages, int nprod, int ncons, int grid, void* out, void* stream) {
  const void* f = tma_fn(P, nstg, B, order);
  if (!f || stages > MAX_STAGES) return -2;
  Maps maps;
  memcpy(&maps, maps_host, sizeof(Maps));
  Levels lv = levels_of(g);
  int N = g[0], Lq = g[1], M = g[2], S = g[3];
  int staged_px = 0;
  for (int s = 0; s < nstg; ++s) staged_px += lv.H[L - nstg + s] * lv.W[L - nstg + s];
  size_t sm = tma_smem(P, nstg, B, stages, staged_px);
  cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
  if (e != cudaSuccess) return (int)e;
  cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  void* args[] = {(void*)&maps, (void*)&value, (void*)&coords, (void*)&lv, &N, &Lq, &M, &S, &stages, &nprod, &out};
  e = cudaLaunchKernel(f, dim3(grid), dim3(32 * (nprod + ncons)), args, sm, (cudaStream_t)stream);
  return (int)e;
}

}  // extern "C"
