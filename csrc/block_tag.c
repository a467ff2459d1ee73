/*
 * block_tag.c - the keyed integrity tag of a block file (dualpath/storage/format.py,
 * format 2): Poly1305 under a one-time key derived from the cluster key and the
 * block's own random nonce,
 *
 *     otk = BLAKE2b-256(key = secret[:64], "dualpath block tag 2" || nonce)
 *     tag = Poly1305(otk, header bytes [0, 128) || payload)
 *
 * (the nonce is header bytes [112, 128), so the tag covers it). Every write draws a
 * fresh nonce, so each one-time key authenticates one message, as Poly1305 requires;
 * without the cluster key the one-time keys are unpredictable. libcrypto's Poly1305
 * runs at several GB/s per core where keyed BLAKE2b runs at ~1, so the tag no longer
 * costs a core per GB read (bench/storage.py prints both).
 *
 * Mechanism only: which blocks carry a tag and what a mismatch means is the store's.
 */
#include "dp.h"

#include <errno.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <string.h>

#define LABEL "dualpath block tag 2"

static EVP_MAC *kdf_mac, *tag_mac;
static pthread_once_t macs_once = PTHREAD_ONCE_INIT;

static void fetch_macs(void)
{
    kdf_mac = EVP_MAC_fetch(NULL, "BLAKE2BMAC", NULL);
    tag_mac = EVP_MAC_fetch(NULL, "POLY1305", NULL);
}

int dp_tag_begin(struct dp_tag *t, const uint8_t *secret, uint32_t secret_len,
                 const uint8_t *nonce)
{
    t->ctx = NULL;
    if (!secret || secret_len < 32 || !nonce)
        return -EINVAL;
    pthread_once(&macs_once, fetch_macs);
    if (!kdf_mac || !tag_mac)
        return -ENOSYS;                         /* a libcrypto without them */
    uint8_t otk[32];
    size_t len = 0, size = sizeof otk;
    OSSL_PARAM p[] = {OSSL_PARAM_construct_size_t(OSSL_MAC_PARAM_SIZE, &size),
                      OSSL_PARAM_construct_end()};
    int rc = -EIO;
    EVP_MAC_CTX *k = EVP_MAC_CTX_new(kdf_mac);
    EVP_MAC_CTX *c = EVP_MAC_CTX_new(tag_mac);
    if (k && c &&
        EVP_MAC_init(k, secret, secret_len > 64 ? 64 : secret_len, p) == 1 &&
        EVP_MAC_update(k, (const uint8_t *)LABEL, sizeof LABEL - 1) == 1 &&
        EVP_MAC_update(k, nonce, DP_TAG_NONCE) == 1 &&
        EVP_MAC_final(k, otk, &len, sizeof otk) == 1 && len == sizeof otk &&
        EVP_MAC_init(c, otk, sizeof otk, NULL) == 1) {
        t->ctx = c;
        c = NULL;
        rc = 0;
    }
    OPENSSL_cleanse(otk, sizeof otk);
    EVP_MAC_CTX_free(k);
    EVP_MAC_CTX_free(c);
    return rc;
}

int dp_tag_update(struct dp_tag *t, const void *data, uint64_t len)
{
    if (!t->ctx)
        return -EINVAL;
    return EVP_MAC_update((EVP_MAC_CTX *)t->ctx, data, len) == 1 ? 0 : -EIO;
}

int dp_tag_end(struct dp_tag *t, uint8_t *out)
{
    if (!t->ctx)
        return -EINVAL;
    size_t len = 0;
    int ok = EVP_MAC_final((EVP_MAC_CTX *)t->ctx, out, &len, DP_TAG_BYTES) == 1 &&
             len == DP_TAG_BYTES;
    EVP_MAC_CTX_free((EVP_MAC_CTX *)t->ctx);
    t->ctx = NULL;
    return ok ? 0 : -EIO;
}

int dp_block_tag(const uint8_t *secret, uint32_t secret_len, const void *head,
                 const void *payload, uint64_t payload_len, uint8_t *out)
{
    struct dp_tag t;
    int rc = dp_tag_begin(&t, secret, secret_len,
                          (const uint8_t *)head + DP_TAG_HEAD - DP_TAG_NONCE);
    if (rc == 0)
        rc = dp_tag_update(&t, head, DP_TAG_HEAD);
    if (rc == 0)
        rc = dp_tag_update(&t, payload, payload_len);
    if (rc == 0)
        return dp_tag_end(&t, out);
    if (t.ctx) {
        uint8_t scratch[DP_TAG_BYTES];
        dp_tag_end(&t, scratch);
    }
    return rc;
}
