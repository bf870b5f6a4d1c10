// Paged attention for XLA:CPU as an XLA FFI custom call (paged_jax/attention/cpu_kernel.py).
//
// Why a native kernel: plain XLA on the CPU can only read a row's blocks by gathering them
// into a fresh buffer (a copy of every K/V byte the step reads, then a second read), and
// XLA:CPU will not fuse that gather into the score and value reductions. This kernel walks
// the block table and reads each block where it lies in the pool: K/V bytes are read once.
//
// One kernel serves both layouts of paged_jax/attention/contract.py, the ragged one:
// q [N, Hq, D] (fp32 here: the adapter casts) holds the queries of every row packed, row b's
// q_lens[b] queries at q[q_starts[b] : q_starts[b] + q_lens[b]] (rows in order, spans not
// overlapping), and the padded [B, T, Hq, D] one as its special case q_starts[b] = b * T.
// pages [L, Hkv, Nblk, bs, D] (fp32, or bf16 / fp16 bit patterns as uint16), block_tables
// int32[B, P], lengths / q_starts / q_lens int32[B], layer int32[] (clamped to [0, L)),
// attribute `scale`; out [N, Hq, D] fp32. Query t < q_lens[b] sits at position
// lengths[b] - q_lens[b] + t and attends to keys [0, that position]; every output row that
// is no row's query is 0. Masked keys are never read, so NaN/Inf in free or stale memory
// cannot reach the result. Scores, softmax and the weighted sum are fp32 (online softmax,
// one pass over the blocks).
//
// Work is split into (row, kv head, chunk of at most kChunk queries) tasks, longest first,
// shared by the caller and XLA's intra-op thread pool: a task converts each block's K and V
// to fp32 once and uses them for every query head of its group and every query of its
// chunk (decode: one query per row; a prefill chunk: up to kChunk). The inner loops (dot
// products over D, the block's exponentials, the weighted sum) are written for the
// compiler to vectorise; `fast_exp` is a polynomial exp it can vectorise (std::exp is a
// scalar call per key).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum PageKind : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr int64_t kChunk = 32;  // queries (tokens) of one row per task

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {  // inf / nan
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {  // normal
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {  // zero
    u = sign;
  } else {  // subnormal: renormalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their running max), relative error ~2e-7 (Cephes' expf
// polynomial after reducing x = n ln2 + r); below -87 it returns 0. Branch-free, so a loop
// of it vectorises.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x <= -87.0f ? 0.0f : p * scale;
}

struct Problem {
  int64_t B, N, Hq, Hkv, G, Nblk, bs, D, P, layer;
  PageKind kind;
  float scale;
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* lengths;
  const int32_t* q_starts;
  const int32_t* q_lens;
  float* out;
};

struct Task {
  int64_t row, head, t0, t1;  // queries [t0, t1) of row `row`, kv head `head`
  int64_t cost;               // keys read x queries: to run the longest first
};

// Real queries of row b: q_lens clamped to [0, lengths].
inline int64_t row_queries(const Problem& p, int64_t b) {
  const int64_t len = std::max<int64_t>(p.lengths[b], 0);
  return std::min<int64_t>(std::max<int64_t>(p.q_lens[b], 0), len);
}

// One block's values as fp32: a pointer into the pool (fp32 pages) or into `scratch`.
inline const float* block_f32(const Problem& p, const void* pool, int64_t offset, int64_t count,
                              float* scratch) {
  if (p.kind == kF32) return static_cast<const float*>(pool) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(pool) + offset;
  if (p.kind == kBF16) {
    for (int64_t i = 0; i < count; ++i) scratch[i] = bf16_to_f32(src[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) scratch[i] = f16_to_f32(src[i]);
  }
  return scratch;
}

// Attention of queries [t0, t1) of row b on kv head g: out[q_starts[b] + t, g*G + h, :].
// kD > 0: the head dim as a compile-time constant (the inner loops unrolled, the
// accumulators kept in registers); 0: any head dim (p.D).
template <int64_t kD>
void run_task(const Problem& p, const Task& task, std::vector<float>& buf) {
  const int64_t D = kD > 0 ? kD : p.D, G = p.G, bs = p.bs;
  const int64_t b = task.row, g = task.head, t0 = task.t0, t1 = task.t1;
  const int64_t len = std::max<int64_t>(p.lengths[b], 0);
  const int64_t q_len = row_queries(p, b);
  const int64_t nq = (t1 - t0) * G;  // queries of this task, query i = (t - t0) * G + h

  buf.resize(static_cast<size_t>(nq * D * 2 + nq * 2 + 2 * bs + 2 * bs * D));
  float* qs = buf.data();          // [nq, D] scaled queries
  float* acc = qs + nq * D;        // [nq, D] weighted value sums
  float* m = acc + nq * D;         // [nq] running max
  float* l = m + nq;               // [nq] running denominators
  float* s = l + nq;               // [bs] one block's scores
  float* w = s + bs;               // [bs] their exponentials
  float* k_tmp = w + bs;           // [bs, D] converted K block
  float* v_tmp = k_tmp + bs * D;   // [bs, D] converted V block

  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t base = p.q_starts[b];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < G; ++h) {
      const float* src = p.q + ((base + t) * p.Hq + g * G + h) * D;
      float* dst = qs + ((t - t0) * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
    }
  }
  std::fill(acc, acc + nq * D, 0.0f);
  std::fill(m, m + nq, neg_inf);
  std::fill(l, l + nq, 0.0f);

  const int64_t first_pos = len - q_len;         // position of query t = 0
  const int64_t last_key = first_pos + t1 - 1;   // the chunk's last query sees keys [0, last_key]
  const int64_t num_blocks = last_key / bs + 1;
  const int64_t head_base = (p.layer * p.Hkv + g) * p.Nblk;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t phys = std::clamp<int64_t>(p.tables[b * p.P + j], 0, p.Nblk - 1);
    const int64_t key0 = j * bs;
    const int64_t keys = std::min(bs, len - key0);  // keys of this block inside the row
    const int64_t offset = (head_base + phys) * bs * D;
    const float* kb = block_f32(p, p.k, offset, keys * D, k_tmp);
    const float* vb = block_f32(p, p.v, offset, keys * D, v_tmp);
    for (int64_t t = t0; t < t1; ++t) {
      // keys [0, first_pos + t] are visible to query t: `visible` of this block's
      const int64_t visible = std::min(keys, first_pos + t + 1 - key0);
      if (visible <= 0) continue;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t i = (t - t0) * G + h;
        const float* qi = qs + i * D;
        for (int64_t c = 0; c < visible; ++c) {
          const float* kc = kb + c * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kc[d];
          s[c] = dot;
        }
        float block_max = neg_inf;
        for (int64_t c = 0; c < visible; ++c) block_max = std::max(block_max, s[c]);
        const float new_m = std::max(m[i], block_max);
        // exp(-inf) = 0 on the first block; fast_exp takes finite arguments only
        const float correction = m[i] == neg_inf ? 0.0f : fast_exp(m[i] - new_m);
        float sum = 0.0f;
        for (int64_t c = 0; c < visible; ++c) {
          w[c] = fast_exp(s[c] - new_m);
          sum += w[c];
        }
        float* ai = acc + i * D;
        if constexpr (kD > 0) {  // the row's accumulator in registers, not re-stored per key
          float a[kD];
          for (int64_t d = 0; d < kD; ++d) a[d] = ai[d] * correction;
          for (int64_t c = 0; c < visible; ++c) {
            const float wc = w[c];
            const float* vc = vb + c * kD;
            for (int64_t d = 0; d < kD; ++d) a[d] += wc * vc[d];
          }
          for (int64_t d = 0; d < kD; ++d) ai[d] = a[d];
        } else {
          for (int64_t d = 0; d < D; ++d) ai[d] *= correction;
          for (int64_t c = 0; c < visible; ++c) {
            const float wc = w[c];
            const float* vc = vb + c * D;
            for (int64_t d = 0; d < D; ++d) ai[d] += wc * vc[d];
          }
        }
        l[i] = l[i] * correction + sum;
        m[i] = new_m;
      }
    }
  }
  float* out_row = p.out + base * p.Hq * D;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < G; ++h) {
      const int64_t i = (t - t0) * G + h;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      float* dst = out_row + (t * p.Hq + g * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
    }
  }
}

// Runs every task on the caller and up to num_threads - 1 pool threads, each taking the
// next task from a shared counter; returns once all have finished.
void run_all(const Problem& p, const std::vector<Task>& tasks, ffi::ThreadPool& pool) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (n == 0) return;
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t helpers_left = 0;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [&p, &tasks, n](Shared& sh) {
    std::vector<float> buf;
    for (int64_t i; (i = sh.next.fetch_add(1)) < n;) {
      if (p.D == 64) {
        run_task<64>(p, tasks[i], buf);
      } else if (p.D == 128) {
        run_task<128>(p, tasks[i], buf);
      } else {
        run_task<0>(p, tasks[i], buf);
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  shared->helpers_left = helpers;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([shared, work]() {
      work(*shared);
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->helpers_left == 0) shared->cv.notify_all();
    });
  }
  work(*shared);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->helpers_left == 0; });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> q_starts,
                              ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> out, float scale, int64_t page_kind) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 5) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: want q [N,Hq,D], pages [L,Hkv,N,bs,D]");
  }
  Problem p;
  p.N = qd[0], p.Hq = qd[1], p.D = qd[2];
  const int64_t L = kd[0];
  p.Hkv = kd[1], p.Nblk = kd[2], p.bs = kd[3];
  p.B = tables.dimensions()[0];
  p.P = tables.dimensions()[1];
  if (kd[4] != p.D || p.Hkv < 1 || p.Hq % p.Hkv != 0 || p.Nblk < 1) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: q and pages do not fit");
  }
  p.G = p.Hq / p.Hkv;
  p.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  p.kind = static_cast<PageKind>(page_kind);
  p.scale = scale;
  p.q = q.typed_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.tables = tables.typed_data();
  p.lengths = lengths.typed_data();
  p.q_starts = q_starts.typed_data();
  p.q_lens = q_lens.typed_data();
  p.out = out->typed_data();

  // Validate, zero every output row no query of a row covers, and cut the work into tasks.
  const int64_t max_len = p.P * p.bs;
  const int64_t row_floats = p.Hq * p.D;
  std::vector<Task> tasks;
  int64_t covered = 0;  // output rows [0, covered) are settled
  for (int64_t b = 0; b < p.B; ++b) {
    if (p.lengths[b] > max_len) {  // a length past the table would read past it
      return ffi::Error::InvalidArgument("paged_attention_cpu: a length exceeds the block table");
    }
    const int64_t nq = row_queries(p, b);
    if (nq == 0) continue;
    const int64_t start = p.q_starts[b];
    if (start < covered || start + nq > p.N) {
      return ffi::Error::InvalidArgument(
          "paged_attention_cpu: rows' query spans must lie in q, in order, without overlap");
    }
    std::memset(p.out + covered * row_floats, 0, sizeof(float) * (start - covered) * row_floats);
    covered = start + nq;
    const int64_t first_pos = std::max<int64_t>(p.lengths[b], 0) - nq;
    for (int64_t t0 = 0; t0 < nq; t0 += kChunk) {
      const int64_t t1 = std::min(nq, t0 + kChunk);
      const int64_t cost = (first_pos + t1) * (t1 - t0);
      for (int64_t g = 0; g < p.Hkv; ++g) tasks.push_back(Task{b, g, t0, t1, cost});
    }
  }
  std::memset(p.out + covered * row_floats, 0, sizeof(float) * (p.N - covered) * row_floats);
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  run_all(p, tasks, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [N, Hq, D]
                                  .Arg<ffi::AnyBuffer>()         // k pages
                                  .Arg<ffi::AnyBuffer>()         // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [N, Hq, D]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("page_kind"));
