// Paged attention for XLA:CPU as an XLA FFI custom call (paged_jax/attention/cpu_kernel.py).
//
// Why a native kernel: plain XLA on the CPU can only read a row's blocks by gathering them
// into a fresh buffer (a copy of every K/V byte the step reads, then a second read), and
// XLA:CPU will not fuse that gather into the score and value reductions. This kernel walks
// the block table and reads each block where it lies in the pool: K/V bytes are read once.
//
// The contract is paged_jax/attention/contract.py's: q [B, T, Hq, D] (fp32 here: the adapter
// casts), pages [L, Hkv, N, bs, D] (fp32, or bf16 / fp16 bit patterns as uint16), block_tables
// int32[B, P], lengths / q_lens int32[B], layer int32[] (clamped to [0, L)), attribute
// `scale`; out [B, T, Hq, D] fp32. Query t < q_lens[b] sits at position
// lengths[b] - q_lens[b] + t and attends to keys [0, that position]; other rows are 0.
// Masked keys are never read, so NaN/Inf in free or stale memory cannot reach the result.
// Scores, softmax and the weighted sum are fp32 (online softmax, one pass over the blocks).
//
// Work is split into (row, kv head) tasks shared by the caller and XLA's intra-op thread
// pool: each task converts a block's K and V to fp32 once and uses them for every query head
// of its group and every query of the row (decode: T = 1; a prefill chunk: T > 1).

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

struct Problem {
  int64_t B, T, Hq, Hkv, G, N, bs, D, P, layer;
  PageKind kind;
  float scale;
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* lengths;
  const int32_t* q_lens;
  float* out;
};

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

// Attention of row b's queries on kv head g: out[b, t, g*G + h, :] for every t and h.
void run_task(const Problem& p, int64_t b, int64_t g, std::vector<float>& buf) {
  const int64_t D = p.D, G = p.G, bs = p.bs;
  const int64_t len = std::max<int64_t>(p.lengths[b], 0);
  const int64_t q_len = std::min<int64_t>(std::clamp<int64_t>(p.q_lens[b], 0, p.T), len);
  const int64_t nq = q_len * G;  // queries of this task, query i = t * G + h
  float* out_row = p.out + b * p.T * p.Hq * D;
  for (int64_t t = 0; t < p.T; ++t) {  // rows that stay 0: every t >= q_len
    if (t < q_len) continue;
    std::memset(out_row + (t * p.Hq + g * G) * D, 0, sizeof(float) * G * D);
  }
  if (nq == 0) return;

  buf.resize(static_cast<size_t>(nq * D * 2 + nq * 2 + bs + 2 * bs * D));
  float* qs = buf.data();          // [nq, D] scaled queries
  float* acc = qs + nq * D;        // [nq, D] weighted value sums
  float* m = acc + nq * D;         // [nq] running max
  float* l = m + nq;               // [nq] running denominators
  float* s = l + nq;               // [bs] one block's scores
  float* k_tmp = s + bs;           // [bs, D] converted K block
  float* v_tmp = k_tmp + bs * D;   // [bs, D] converted V block

  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < q_len; ++t) {
    for (int64_t h = 0; h < G; ++h) {
      const float* src = p.q + ((b * p.T + t) * p.Hq + g * G + h) * D;
      float* dst = qs + (t * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
    }
  }
  std::fill(acc, acc + nq * D, 0.0f);
  std::fill(m, m + nq, neg_inf);
  std::fill(l, l + nq, 0.0f);

  const int64_t first_pos = len - q_len;  // position of query t = 0
  const int64_t num_blocks = (len + bs - 1) / bs;
  const int64_t head_base = (p.layer * p.Hkv + g) * p.N;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t phys = std::clamp<int64_t>(p.tables[b * p.P + j], 0, p.N - 1);
    const int64_t key0 = j * bs;
    const int64_t keys = std::min(bs, len - key0);  // keys of this block inside the row
    const int64_t offset = (head_base + phys) * bs * D;
    const float* kb = block_f32(p, p.k, offset, keys * D, k_tmp);
    const float* vb = block_f32(p, p.v, offset, keys * D, v_tmp);
    for (int64_t t = 0; t < q_len; ++t) {
      // keys [0, first_pos + t] are visible to query t: `visible` of this block's
      const int64_t visible = std::min(keys, first_pos + t + 1 - key0);
      if (visible <= 0) continue;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t i = t * G + h;
        const float* qi = qs + i * D;
        float block_max = neg_inf;
        for (int64_t c = 0; c < visible; ++c) {
          const float* kc = kb + c * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kc[d];
          s[c] = dot;
          block_max = std::max(block_max, dot);
        }
        const float new_m = std::max(m[i], block_max);
        const float correction = std::exp(m[i] - new_m);  // exp(-inf) = 0 on the first block
        float* ai = acc + i * D;
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) ai[d] *= correction;
        for (int64_t c = 0; c < visible; ++c) {
          const float w = std::exp(s[c] - new_m);
          sum += w;
          const float* vc = vb + c * D;
          for (int64_t d = 0; d < D; ++d) ai[d] += w * vc[d];
        }
        l[i] = l[i] * correction + sum;
        m[i] = new_m;
      }
    }
  }
  for (int64_t t = 0; t < q_len; ++t) {
    for (int64_t h = 0; h < G; ++h) {
      const int64_t i = t * G + h;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      float* dst = out_row + (t * p.Hq + g * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
    }
  }
}

// Runs every (row, kv head) task on the caller and up to num_threads - 1 pool threads, each
// taking the next task from a shared counter; returns once all have finished.
void run_all(const Problem& p, ffi::ThreadPool& pool) {
  const int64_t tasks = p.B * p.Hkv;
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t helpers_left = 0;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [&p, tasks](Shared& sh) {
    std::vector<float> buf;
    for (int64_t i; (i = sh.next.fetch_add(1)) < tasks;) run_task(p, i / p.Hkv, i % p.Hkv, buf);
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), tasks) - 1;
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
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                              float scale, int64_t page_kind) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 5) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: want q [B,T,Hq,D], pages [L,Hkv,N,bs,D]");
  }
  Problem p;
  p.B = qd[0], p.T = qd[1], p.Hq = qd[2], p.D = qd[3];
  const int64_t L = kd[0];
  p.Hkv = kd[1], p.N = kd[2], p.bs = kd[3];
  p.P = tables.dimensions()[1];
  if (kd[4] != p.D || p.Hkv < 1 || p.Hq % p.Hkv != 0 || p.N < 1) {
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
  p.q_lens = q_lens.typed_data();
  p.out = out->typed_data();
  const int64_t max_len = p.P * p.bs;
  for (int64_t b = 0; b < p.B; ++b) {  // a length past the table would read past it
    if (p.lengths[b] > max_len) {
      return ffi::Error::InvalidArgument("paged_attention_cpu: a length exceeds the block table");
    }
  }
  run_all(p, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k pages
                                  .Arg<ffi::AnyBuffer>()         // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("page_kind"));
