/* runs.c - a layer's WRITE runs and their slices, one C call each, whatever the number
 * of blocks (dualpath/kv/placement.py run_arrays, dualpath/transfer/plan.py plan_rows:
 * the per-layer work of a transfer, which was ~25 numpy calls or a Python loop a block). */
#include <errno.h>

#include "dp.h"

static inline uint64_t side_offset(const struct dp_run_side *sd, uint32_t layer, uint32_t nseg,
                                   uint32_t s, uint64_t u)
{
    return (uint64_t)sd->bases[(uint64_t)layer * nseg + s] + (u / sd->group) * sd->group_stride
           + (u % sd->group) * sd->unit_stride;
}

int64_t dp_layer_runs(const struct dp_run_side *src, const struct dp_run_side *dst,
                      const uint64_t *row_bytes, uint32_t nseg, uint32_t layer,
                      uint64_t unit_tokens, uint64_t first, uint64_t stop, uint64_t *out,
                      uint64_t cap)
{
    if (!src || !dst || !row_bytes || !out || nseg == 0 || unit_tokens == 0)
        return -EINVAL;
    if (stop <= first)
        return 0;
    uint64_t i0 = first / unit_tokens, i1 = (stop - 1) / unit_tokens + 1;
    if ((i1 - i0) > cap / nseg)
        return -ENOSPC;
    uint64_t n = 0;
    for (uint64_t i = i0; i < i1; i++) {
        int64_t su = src->units[i - i0], du = dst->units[i - i0];
        if (su < 0 || (uint64_t)su >= src->num_units || du < 0
            || (uint64_t)du >= dst->num_units) {
            const struct dp_run_side *bad = su < 0 || (uint64_t)su >= src->num_units ? src : dst;
            out[0] = (uint64_t)(bad == src ? su : du);
            out[1] = bad == src ? 0 : 1;
            return -ERANGE;
        }
        uint64_t base_tok = i * unit_tokens;
        uint64_t t0 = first > base_tok ? first - base_tok : 0;
        uint64_t t1 = stop - base_tok < unit_tokens ? stop - base_tok : unit_tokens;
        for (uint32_t s = 0; s < nseg; s++) {
            uint64_t so = side_offset(src, layer, nseg, s, (uint64_t)su) + t0 * row_bytes[s];
            uint64_t dof = side_offset(dst, layer, nseg, s, (uint64_t)du) + t0 * row_bytes[s];
            uint64_t len = (t1 - t0) * row_bytes[s];
            uint64_t *last = n ? &out[3 * (n - 1)] : NULL;
            if (last && last[0] + last[2] == so && last[1] + last[2] == dof) {
                last[2] += len;             /* contiguous on both sides: one run */
            } else {
                out[3 * n] = so;
                out[3 * n + 1] = dof;
                out[3 * n + 2] = len;
                n++;
            }
        }
    }
    return (int64_t)n;
}

int64_t dp_plan_rows(const uint64_t *items, uint64_t n, uint64_t slice_bytes,
                     uint64_t local_length, uint64_t remote_length, uint64_t *out,
                     uint64_t cap, uint64_t *bad)
{
    if ((!items && n) || !bad || slice_bytes == 0)
        return -EINVAL;
    uint64_t need = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t lo = items[3 * i], ro = items[3 * i + 1], len = items[3 * i + 2];
        if (len == 0 || lo > local_length || len > local_length - lo
            || ro > remote_length || len > remote_length - ro) {
            bad[0] = i;
            return -ERANGE;
        }
        need += (len + slice_bytes - 1) / slice_bytes;
    }
    if (need > cap || (need && !out)) {
        bad[0] = need;
        return -ENOSPC;
    }
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t lo = items[3 * i], ro = items[3 * i + 1], len = items[3 * i + 2];
        for (uint64_t off = 0; off < len; off += slice_bytes, k++) {
            out[3 * k] = lo + off;
            out[3 * k + 1] = ro + off;
            out[3 * k + 2] = len - off < slice_bytes ? len - off : slice_bytes;
        }
    }
    return (int64_t)k;
}
