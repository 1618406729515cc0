/* kvclient.h: the C ABI of libkvclient.so (README.md, "C ABI conventions").
 *
 * Conventions:
 * - Every function returns a status code (int) unless noted. Positive codes
 *   mean "not served: recompute"; negative codes mean the caller erred
 *   (KV_EINVAL, or KV_EDENIED: the group's auth token is missing or wrong)
 *   or the library has a bug (KV_EINTERNAL). Codes are never reused.
 * - Every pointer argument is checked: NULL where a value is required is
 *   KV_EINVAL, never a crash. Output pointers documented as optional may be NULL.
 * - Panics never cross this boundary: they become KV_EINTERNAL.
 * - kv_last_error() describes the calling thread's last failure, for positive
 *   codes too (which node, and what it or the network said).
 * - One kv_client handle is safe to share between threads. A handle is a
 *   token, never dereferenced: a call on a closed handle is KV_EINVAL, and
 *   kv_close waits for the calls in flight on other threads, then frees.
 * - Keys are NUL-terminated strings of 1..=1024 bytes. Limits apply per item,
 *   never to a batch's total: one item has at most KV_MAX_ITEM_IOVCNT
 *   segments, one batch at most KV_MAX_BATCH_ITEMS items (more: KV_EINVAL).
 * - Output segments (kv_getv, kv_batch_getv) must not overlap, within an item
 *   or across a batch's items: overlapping ones are refused with KV_EINVAL.
 * - Checked against the Rust definitions by the test suite (tests/tests/c_abi.rs).
 */
#ifndef KVCLIENT_H
#define KVCLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KV_OK 0
#define KV_MISS 1
#define KV_MISMATCH 2
#define KV_CORRUPT 3
#define KV_TOO_SMALL 4
#define KV_UNAVAILABLE 5
#define KV_TIMEOUT 6
#define KV_REJECTED 7
#define KV_EINVAL -1
#define KV_EINTERNAL -2
#define KV_EDENIED -3

#define KV_MAX_ITEM_IOVCNT 4096
#define KV_MAX_BATCH_ITEMS 65536

/* Header flag bit 0: an MLA page, replicated across TP ranks (tp_size and
   tp_rank are then not compared). */
#define KV_FLAG_MLA 1

typedef struct kv_client kv_client;
typedef struct kv_iovec { void *base; size_t len; } kv_iovec;
typedef struct kv_geometry {
  uint64_t model_hash; uint32_t page_size; uint32_t dtype_tag;
  uint16_t tp_size, tp_rank, layer_num, head_num, head_dim, flags;
} kv_geometry;

/* members: "id=host:port[@weight],..." or "" (discovery only);
   options: NULL or "key=value,..." e.g. "io_timeout_ms=10000,batch_concurrency=8";
   keys (defaults): connect_timeout_ms (3000), io_timeout_ms (10000),
   max_conns_per_node (16), batch_concurrency (8), peer_cooldown_ms (2000),
   auth_token_file (none: a path, read once here, holding the group's token;
   it cannot contain a comma), rdma_devices (none: TCP; ':'-separated device
   names, e.g. mlx5_0:mlx5_1, one rail each), rdma_depth (32: work requests
   in flight per queue pair), rdma_numa (1: prefer rails on the calling
   thread's NUMA node), rdma_cache_mb (1024: registrations of buffers not
   given to kv_register_memory kept per rail, for gets and for puts each;
   0: per operation),
   handoff_ms (600000: after a change of the member set, how long a key
   that misses at its owner is also asked at its previous owners, where the
   kv-mds view does not say; 0 turns this ring handoff off), handoff_timeout_ms
   (500: the longest one such ask may take), handoff_budget_mb (256: bytes of
   pages found at a previous owner being copied to their owner at once),
   placement (ketama: the rule placing keys on a static member list, or
   multiprobe; docs/PROTOCOL.md section 4; under MDS discovery the group's
   view names the rule and this is not used).
   Ring handoff assumes a key always names the same bytes: set handoff_ms=0
   if keys are reused for other values. Every build
   takes the rdma_ keys; when RDMA cannot be used the handle serves over TCP,
   prints one line to stderr saying why and counts it in
   kvclient_rdma_fallbacks_total. Unknown keys are an error. Returns NULL on
   error (see kv_last_error). */
kv_client *kv_open(const char *members, const kv_geometry *geo, const char *options);
/* Waits for calls in flight on other threads (each ends within its own
   timeouts: a batch may take several I/O timeouts), then frees; later calls
   with the handle are KV_EINVAL. NULL or an already closed handle is a no-op. */
void kv_close(kv_client *c);
/* Replaces the member set; safe while other threads issue requests. */
int kv_set_members(kv_client *c, const char *members);
/* Membership through kv-mds: long-polls group's view (each poll waits up to
   poll_ms) on "host:port,..." with failover, rebuilding the ring when the
   epoch changes. KV_OK once the first view is applied; KV_UNAVAILABLE if no
   MDS answered yet (discovery keeps trying in the background); KV_EDENIED if
   the MDS refused the auth token. Calling it again replaces the previous
   discovery. */
int kv_start_mds_discovery(kv_client *c, const char *mds_endpoints_csv, const char *group, int poll_ms);
uint64_t kv_epoch(const kv_client *c); /* ring epoch in use (the MDS epoch under discovery); 0 for NULL */

/* Bounds every later call the calling thread makes (on any handle) to
   about ms milliseconds in all; 0 (the default) leaves each request bounded
   by the handle's own timeouts only. Returns the previous bound. Every
   request of a call gets at most what is left of the call's time; items not
   answered by then get KV_TIMEOUT, and the call returns only after all of
   its work has stopped: nothing of it reads or writes the caller's buffers
   after it returns. A node that let a request run at least half the call's
   time without an answer starts its cool-down (peer_cooldown_ms): every
   call skips it meanwhile (KV_UNAVAILABLE at once). For engine plugins
   that must bound a step yet never abandon engine memory. */
uint32_t kv_set_call_timeout_ms(uint32_t ms);

/* Write-once: a put of a key already stored succeeds without rewriting it. */
int kv_put(kv_client *c, const char *key, const void *buf, size_t len);
int kv_putv(kv_client *c, const char *key, const kv_iovec *iov, size_t iovcnt);
/* On KV_OK *out_len is the payload length; on KV_TOO_SMALL the size needed.
   out_len is optional. On any code but KV_OK the buffer contents are
   unspecified. */
int kv_get(kv_client *c, const char *key, void *buf, size_t cap, size_t *out_len);
int kv_getv(kv_client *c, const char *key, const kv_iovec *iov, size_t iovcnt, size_t *out_len);
/* KV_OK only where a get by this client would hit (geometry compared). */
int kv_exist(kv_client *c, const char *key);
/* Removes key at its owner (and, inside a ring-handoff window, at its
   previous owners): KV_OK, or KV_MISS when none of them stored it. */
int kv_delete(kv_client *c, const char *key);

/* Batches: item i uses iovcnt[i] consecutive entries of iov. Items fan out to
   their owners concurrently. Return the number of items with KV_OK (>= 0) or a
   negative code (KV_EDENIED when any owner refused the auth token); per-item
   codes go to out_status (required); out_lens is optional. */
int kv_batch_putv(kv_client *c, size_t n, const char *const *keys, const kv_iovec *iov,
                  const size_t *iovcnt, int *out_status);
int kv_batch_getv(kv_client *c, size_t n, const char *const *keys, const kv_iovec *iov,
                  const size_t *iovcnt, size_t *out_lens, int *out_status);
int kv_batch_exist(kv_client *c, size_t n, const char *const *keys, int *out_status);
/* Removes n keys at their owners (as kv_delete does each): per key KV_OK or
   KV_MISS in out_status; returns the number removed (KV_OK). */
int kv_batch_delete(kv_client *c, size_t n, const char *const *keys, int *out_status);

/* RDMA: registers a long-lived region (an engine's host pool) once with
   every rail, so pages move to and from it without per-call registration;
   it must stay mapped until kv_unregister_memory or kv_close. KV_OK (also
   on TCP, where it does nothing), KV_UNAVAILABLE when the device refuses it
   (RLIMIT_MEMLOCK, memory not registrable): the handle then serves over TCP,
   says why on stderr once and counts it in kvclient_rdma_fallbacks_total. */
int kv_register_memory(kv_client *c, void *base, size_t len);
/* Drops the registration kv_register_memory made at base: KV_OK, or KV_MISS
   when none starts there (KV_OK on TCP). */
int kv_unregister_memory(kv_client *c, void *base);
/* Prometheus text into buf (NUL-terminated, truncated to cap); returns the
   full length without the NUL, so a caller can size its buffer. */
size_t kv_stats_snapshot(kv_client *c, char *buf, size_t cap);
const char *kv_last_error(void); /* thread-local, never NULL */
const char *kv_version(void);

#ifdef __cplusplus
}
#endif

#endif /* KVCLIENT_H */
