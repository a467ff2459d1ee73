/* items.c - dp_item arrays filled from planned rows: one call per post, not six
 * cffi stores per WRITE (the transfer engine's post path, dualpath/transfer/engine.py). */
#include "dp.h"

void dp_items_fill(struct dp_item *out, uint32_t n, const uint64_t *rows,
                   uint64_t local_base, uint32_t lkey, uint64_t remote_base,
                   uint32_t rkey, uint64_t first_wr_id)
{
    for (uint32_t k = 0; k < n; k++, rows += 3) {
        struct dp_item *d = &out[k];
        d->local_addr = local_base + rows[0];
        d->remote_addr = remote_base + rows[1];
        d->length = (uint32_t)rows[2];
        d->lkey = lkey;
        d->rkey = rkey;
        d->flags = 0;
        d->wr_id = first_wr_id + k;
    }
}

/* The same with one rkey per row (``rkeys[k]``): WRITEs into a peer's scoped region land
 * through the window its grant made for us, one per run (verbs_provider.py). */
void dp_items_fill_keyed(struct dp_item *out, uint32_t n, const uint64_t *rows,
                         uint64_t local_base, uint32_t lkey, uint64_t remote_base,
                         const uint32_t *rkeys, uint64_t first_wr_id)
{
    dp_items_fill(out, n, rows, local_base, lkey, remote_base, 0, first_wr_id);
    for (uint32_t k = 0; k < n; k++)
        out[k].rkey = rkeys[k];
}
