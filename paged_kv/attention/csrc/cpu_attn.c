/* Paged attention on the CPU, reading K and V in place through the block tables: the CPU_ATTN backend
 * of paged_kv (lessons 05, 06). Built once by paged_kv/attention/cpu_build.py (cc -O3 -fopenmp) and
 * called through ctypes by paged_kv/attention/backends/cpu_attn.py, which checks every argument.
 *
 * One call computes a whole packed step: request b's query tokens are rows
 * query_start_loc[b] .. query_start_loc[b + 1] - 1 of `query`, the last of its seq_lens[b] tokens, so
 * its token t sits at position seq_lens[b] - query_len + t and sees positions 0 .. its own (causal),
 * only the last `sliding_window` of them when sliding_window > 0. Token p of request b is slot
 * p % block_size of block block_table[b * table_stride + p / block_size].
 *
 * Work is split in tasks of (request, KV head, tile of query tokens): a tile holds the GROUP query
 * heads of its KV head for up to TILE tokens (1 for a decode), at most MAX_ROWS rows, so each block's
 * K and V are read once per task and met by every row. A task walks its request's blocks from the
 * first one its tile's window reaches to the block of its last token, keeping for each row an online
 * softmax in float32: the running maximum m, the running sum l of exp(score - m), and acc, the running
 * sum of those weights times V (rescaled by exp(m_old - m_new) when the maximum rises). Only the slots a
 * row sees are read: never a slot past its position (the tail of the last block may hold anything),
 * never a block wholly before its window (an engine's null block, say), never a padding entry of the
 * table. The next block's K and V are prefetched while the current one is computed: blocks lie
 * scattered over the pool, and the hardware prefetcher stops at each one's end. They are fetched into
 * the L2 cache, not the L1: a block is dozens of cache lines, and asking the L1 for all of them at
 * once stalls the loads the current block needs (measured: the kernel 1.3 to 1.4 times faster, from
 * about 2 times SDPA over contiguous K/V to 1.1 on a 2-core AMD EPYC, bench/bench_attention.py).
 *
 * The cache's numbers are read as `cache_kind` says: float32 in place, or converted block by block
 * into a float32 buffer (bfloat16 by a shift; float16 and the fp8 formats through `lut`, the float32
 * value of every bit pattern). Scores are scale * q . k (an fp8 cache's k_scale folded into `scale`
 * by the caller), then softcap * tanh(score / softcap) when softcap > 0; outputs are acc / l * v_scale.
 *
 * Invariants the caller guarantees: query_start_loc[0] == 0 and it never decreases; every query length
 * is at most its seq_len; the first ceil(seq_len / block_size) entries of each table row (from the
 * window's first block on) are block ids of the cache; num_kv_heads divides num_heads; `query` and
 * `out` are contiguous (num_tokens, num_heads, head_dim) float32; strides are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KIND_FLOAT32 = 0, KIND_BFLOAT16 = 1, KIND_LUT16 = 2, KIND_LUT8 = 3 };
#define MAX_ROWS 16

/* exp(x) for x <= 0, in a form the compiler vectorizes: Cephes' expf polynomial (about 1 ulp) on
 * x = n ln 2 + r; exactly 0 below -87 (the weights are relative to the row's maximum, 1). */
static inline float exp_nonpositive(float x) {
  float clamped = x < -87.0f ? -87.0f : x;
  int n = (int)(clamped * 1.44269504088896341f - 0.5f); /* rounds to nearest for x <= 0 */
  float fn = (float)n;
  float r = clamped - fn * 0.693359375f + fn * 2.12194440e-4f;
  float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
             1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  union { int32_t i; float f; } two_to_n = {.i = (n + 127) << 23};
  return x < -87.0f ? 0.0f : y * two_to_n.f;
}

static inline float dot(const float *a, const float *b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
  return sum;
}

/* scores[s] = q . k[s] for slots a .. b - 1 of a block whose slot s starts at k + s * slot_stride;
 * four slots at a time, so four independent sums are in flight. */
static void block_scores(float *scores, const float *q, const float *k, int64_t slot_stride, int64_t a,
                         int64_t b, int64_t dim) {
  int64_t s = a;
  for (; s + 4 <= b; s += 4) {
    const float *k0 = k + s * slot_stride, *k1 = k0 + slot_stride, *k2 = k1 + slot_stride, *k3 = k2 + slot_stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < dim; d++) {
      s0 += q[d] * k0[d];
      s1 += q[d] * k1[d];
      s2 += q[d] * k2[d];
      s3 += q[d] * k3[d];
    }
    scores[s] = s0;
    scores[s + 1] = s1;
    scores[s + 2] = s2;
    scores[s + 3] = s3;
  }
  for (; s < b; s++) scores[s] = dot(q, k + s * slot_stride, dim);
}

/* acc += sum over slots a .. b - 1 of weights[s] * v[s], four slots at a time. */
static void accumulate(float *acc, const float *weights, const float *v, int64_t slot_stride, int64_t a,
                       int64_t b, int64_t dim) {
  int64_t s = a;
  for (; s + 4 <= b; s += 4) {
    const float *v0 = v + s * slot_stride, *v1 = v0 + slot_stride, *v2 = v1 + slot_stride, *v3 = v2 + slot_stride;
    float w0 = weights[s], w1 = weights[s + 1], w2 = weights[s + 2], w3 = weights[s + 3];
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) acc[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
  }
  for (; s < b; s++) {
    const float *v0 = v + s * slot_stride;
    float w0 = weights[s];
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) acc[d] += w0 * v0[d];
  }
}

static int64_t element_size(int32_t kind) { return kind == KIND_FLOAT32 ? 4 : kind == KIND_LUT8 ? 1 : 2; }

/* Slots from .. slots - 1 of one block and head (slot s at base + s * strides[2], dimension d at
 * + d * strides[3], in elements of `kind`) as float32 rows of `dim` numbers, row s for slot s: in
 * place when they are float32 rows already, else converted into `buffer`. Sets *slot_stride to the
 * rows' stride. */
static const float *block_rows(const char *base, const int64_t *strides, int32_t kind, const float *lut,
                               int64_t from, int64_t slots, int64_t dim, float *buffer, int64_t *slot_stride) {
  if (kind == KIND_FLOAT32 && strides[3] == 1) {
    *slot_stride = strides[2];
    return (const float *)base;
  }
  int64_t size = element_size(kind);
  for (int64_t s = from; s < slots; s++) {
    const char *row = base + s * strides[2] * size;
    float *into = buffer + s * dim;
    for (int64_t d = 0; d < dim; d++) {
      const char *x = row + d * strides[3] * size;
      if (kind == KIND_FLOAT32) {
        into[d] = *(const float *)x;
      } else if (kind == KIND_BFLOAT16) {
        union { uint32_t u; float f; } bits = {.u = (uint32_t)(*(const uint16_t *)x) << 16};
        into[d] = bits.f;
      } else if (kind == KIND_LUT16) {
        into[d] = lut[*(const uint16_t *)x];
      } else {
        into[d] = lut[*(const uint8_t *)x];
      }
    }
  }
  *slot_stride = dim;
  return buffer;
}

/* Asks for every cache line of one block and head, into the L2 (locality 2; see the top). */
static void prefetch_block(const char *base, const int64_t *strides, int64_t size, int64_t slots, int64_t dim) {
  for (int64_t s = 0; s < slots; s++) {
    const char *row = base + s * strides[2] * size;
    for (int64_t offset = 0; offset < dim * strides[3] * size; offset += 64) __builtin_prefetch(row + offset, 0, 2);
  }
}

/* Returns 0, or 1 when a work buffer could not be allocated (nothing is then guaranteed of `out`). */
int paged_attention(float *out, const float *query, const char *k_cache, const char *v_cache, int32_t cache_kind,
                    const float *lut, const int64_t *k_strides, const int64_t *v_strides, const int32_t *block_table,
                    int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale,
                    float v_scale, int64_t sliding_window, float softcap, int64_t num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile = group >= MAX_ROWS ? 1 : MAX_ROWS / group; /* query tokens per task of a chunk */
  const int64_t size = element_size(cache_kind);
  int64_t *first_task = malloc((num_seqs + 1) * sizeof(int64_t)); /* request b's tiles: [b] .. [b + 1] - 1 */
  if (!first_task) return 1;
  first_task[0] = 0;
  for (int64_t b = 0; b < num_seqs; b++) {
    int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
    int64_t per_tile = query_len <= 1 ? 1 : tile;
    first_task[b + 1] = first_task[b] + (query_len + per_tile - 1) / per_tile;
  }
  const int64_t tasks = first_task[num_seqs] * num_kv_heads;
  int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  {
    const int64_t rows_max = group * tile;
    float *work = malloc(sizeof(float) * (2 * rows_max * dim + rows_max * block_size + 2 * rows_max +
                                          (cache_kind == KIND_FLOAT32 ? 2 : 2 * block_size * dim)));
    if (!work) {
#pragma omp atomic write
      failed = 1;
    }
    float *q = work, *acc = q + rows_max * dim, *scores = acc + rows_max * dim;
    float *m = scores + rows_max * block_size, *l = m + rows_max, *k_buffer = l + rows_max;
    float *v_buffer = k_buffer + block_size * dim;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
      if (!work) continue;
      const int64_t kv_head = task % num_kv_heads, tile_index = task / num_kv_heads;
      int64_t lo = 0, hi = num_seqs; /* the request whose tiles hold tile_index */
      while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (first_task[mid] <= tile_index) lo = mid; else hi = mid;
      }
      const int64_t seq = lo, q_start = query_start_loc[seq], query_len = query_start_loc[seq + 1] - q_start;
      const int64_t per_tile = query_len <= 1 ? 1 : tile;
      const int64_t t0 = (tile_index - first_task[seq]) * per_tile;
      const int64_t tokens = query_len - t0 < per_tile ? query_len - t0 : per_tile, rows = tokens * group;
      const int64_t first_pos = seq_lens[seq] - query_len + t0; /* the tile's first query token's position */
      const int64_t end = first_pos + tokens;                   /* positions below it may be seen */
      int64_t first = sliding_window > 0 ? first_pos - sliding_window + 1 : 0; /* the first one any row sees */
      if (first < 0) first = 0;

      for (int64_t t = 0; t < tokens; t++)
        for (int64_t g = 0; g < group; g++) { /* row t * group + g: token t, query head kv_head * group + g */
          const float *from = query + ((q_start + t0 + t) * num_heads + kv_head * group + g) * dim;
          float *row = q + (t * group + g) * dim;
          for (int64_t d = 0; d < dim; d++) row[d] = from[d] * scale;
        }
      memset(acc, 0, sizeof(float) * rows * dim);
      for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
      }
      const int32_t *table = block_table + seq * table_stride;
      for (int64_t j = first / block_size; j * block_size < end; j++) {
        const int64_t base = j * block_size, slots = end - base < block_size ? end - base : block_size;
        const char *k_block = k_cache + ((int64_t)table[j] * k_strides[0] + kv_head * k_strides[1]) * size;
        const char *v_block = v_cache + ((int64_t)table[j] * v_strides[0] + kv_head * v_strides[1]) * size;
        if (base + block_size < end) {
          const int64_t next = table[j + 1], next_slots = end - base - block_size < block_size ? end - base - block_size : block_size;
          prefetch_block(k_cache + (next * k_strides[0] + kv_head * k_strides[1]) * size, k_strides, size, next_slots, dim);
          prefetch_block(v_cache + (next * v_strides[0] + kv_head * v_strides[1]) * size, v_strides, size, next_slots, dim);
        }
        const int64_t from = first - base > 0 ? first - base : 0; /* the first slot any row sees */
        int64_t k_stride, v_stride;
        const float *k = block_rows(k_block, k_strides, cache_kind, lut, from, slots, dim, k_buffer, &k_stride);
        const float *v = block_rows(v_block, v_strides, cache_kind, lut, from, slots, dim, v_buffer, &v_stride);
        for (int64_t r = 0; r < rows; r++) {
          const int64_t position = first_pos + r / group;
          int64_t a = sliding_window > 0 ? position - sliding_window + 1 - base : 0, b = position + 1 - base;
          if (a < 0) a = 0;
          if (b > slots) b = slots;
          if (a >= b) continue; /* the row sees no slot of this block */
          float *row_scores = scores + r * block_size;
          block_scores(row_scores, q + r * dim, k, k_stride, a, b, dim);
          if (softcap > 0.0f)
            for (int64_t s = a; s < b; s++) row_scores[s] = softcap * tanhf(row_scores[s] / softcap);
          float top = m[r], sum = 0.0f;
          for (int64_t s = a; s < b; s++) top = row_scores[s] > top ? row_scores[s] : top;
#pragma omp simd reduction(+ : sum)
          for (int64_t s = a; s < b; s++) {
            float weight = exp_nonpositive(row_scores[s] - top);
            row_scores[s] = weight;
            sum += weight;
          }
          const float rescale = expf(m[r] - top); /* 0 before the row's first slot: m is -inf */
          float *row_acc = acc + r * dim;
          if (rescale != 1.0f)
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) row_acc[d] *= rescale;
          l[r] = l[r] * rescale + sum;
          m[r] = top;
          accumulate(row_acc, row_scores, v, v_stride, a, b, dim);
        }
      }
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t g = 0; g < group; g++) {
          const int64_t r = t * group + g;
          const float factor = v_scale / l[r]; /* l > 0: every row sees its own position */
          float *into = out + ((q_start + t0 + t) * num_heads + kv_head * group + g) * dim;
          for (int64_t d = 0; d < dim; d++) into[d] = acc[r * dim + d] * factor;
        }
    }
    free(work);
  }
  free(first_task);
  return failed;
}
