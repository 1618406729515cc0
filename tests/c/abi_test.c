/* The C ABI against real kv-server processes (driven by tests/tests/c_abi.rs).
 *
 * usage: abi_test put  MEMBERS DEAD_MEMBER   -> phase 1: all checks, stores "corrupt-me"
 *        abi_test corrupt MEMBERS            -> phase 2: "corrupt-me" must be KV_CORRUPT
 * Prints "ok: ..." per check; exits 0 when all hold, 1 on the first failure.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvclient.h"

static int failures = 0;
#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (cond) {                                                            \
      printf("ok: " __VA_ARGS__);                                          \
      printf("\n");                                                        \
    } else {                                                               \
      printf("FAIL (%s:%d): ", __FILE__, __LINE__);                        \
      printf(__VA_ARGS__);                                                 \
      printf(" [last error: %s]\n", kv_last_error());                      \
      failures++;                                                          \
    }                                                                      \
  } while (0)

static kv_geometry geometry(uint64_t model) {
  kv_geometry g;
  memset(&g, 0, sizeof g);
  g.model_hash = model;
  g.page_size = 64;
  g.dtype_tag = 7;
  g.tp_size = 2;
  g.tp_rank = 1;
  g.layer_num = 4;
  g.head_num = 8;
  g.head_dim = 128;
  return g;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 31u + seed * 7u) & 0xff);
}

/* A thread that keeps calling on a handle another thread closes: each call
   either completes or answers KV_EINVAL (closed), never touches freed memory
   (valgrind watches the whole run). */
static void *hammer(void *arg) {
  kv_client *h = (kv_client *)arg;
  unsigned char b[4096];
  size_t got;
  for (int i = 0; i < 300; i++) {
    int r = kv_get(h, "page-1", b, sizeof b, &got);
    int e = kv_exist(h, "page-1");
    if (r == KV_EINVAL && e == KV_EINVAL) return (void *)1; /* saw the close */
    if (r < 0 && r != KV_EINVAL) return (void *)2;
  }
  return (void *)0;
}

static int phase_put(const char *members, const char *dead) {
  kv_geometry g = geometry(42);
  kv_client *c = kv_open(members, &g, "io_timeout_ms=5000,peer_cooldown_ms=2000");
  CHECK(c != NULL, "kv_open");
  if (!c) return 1;
  CHECK(kv_epoch(c) >= 1, "epoch %llu", (unsigned long long)kv_epoch(c));

  /* Round trip of a 1 MiB page. */
  size_t n = 1 << 20;
  unsigned char *src = malloc(n), *dst = malloc(n);
  fill(src, n, 1);
  CHECK(kv_put(c, "page-1", src, n) == KV_OK, "put");
  {
    unsigned char *other = malloc(n);
    fill(other, n, 9);
    CHECK(kv_put(c, "page-1", other, n) == KV_OK, "second put of a key is ok (write-once)");
    free(other);
  }
  size_t got = 0;
  memset(dst, 0, n);
  CHECK(kv_get(c, "page-1", dst, n, &got) == KV_OK && got == n && memcmp(src, dst, n) == 0,
        "get round trip: the first write's bytes");
  CHECK(kv_exist(c, "page-1") == KV_OK, "exist");
  CHECK(kv_exist(c, "never-stored") == KV_MISS, "exist miss");
  CHECK(kv_get(c, "never-stored", dst, n, &got) == KV_MISS, "get miss");

  /* Scatter/gather: put from 3 segments, get into 2 of other sizes. */
  unsigned char a[1000], b[3000], d[500], x[2500], y[2000];
  fill(a, sizeof a, 2); fill(b, sizeof b, 3); fill(d, sizeof d, 4);
  kv_iovec in[3] = {{a, sizeof a}, {b, sizeof b}, {d, sizeof d}};
  CHECK(kv_putv(c, "sg-1", in, 3) == KV_OK, "putv of 3 segments");
  kv_iovec out[2] = {{x, sizeof x}, {y, sizeof y}};
  CHECK(kv_getv(c, "sg-1", out, 2, &got) == KV_OK && got == 4500, "getv into 2 segments (%zu)", got);
  unsigned char whole[4500];
  memcpy(whole, x, 2500); memcpy(whole + 2500, y, 2000);
  CHECK(memcmp(whole, a, 1000) == 0 && memcmp(whole + 1000, b, 3000) == 0 && memcmp(whole + 4000, d, 500) == 0,
        "scattered bytes in order");

  /* Too small: the size needed comes back. */
  got = 0;
  CHECK(kv_get(c, "page-1", dst, 100, &got) == KV_TOO_SMALL && got == n, "too small reports %zu", got);

  /* Another geometry: exist and get both say mismatch. */
  kv_geometry other = geometry(43);
  kv_client *c2 = kv_open(members, &other, NULL);
  CHECK(kv_exist(c2, "page-1") == KV_MISMATCH, "exist with another model");
  CHECK(kv_get(c2, "page-1", dst, n, &got) == KV_MISMATCH, "get with another model");
  kv_close(c2);

  /* Batch with one dead node among the members. */
  char with_dead[1024];
  snprintf(with_dead, sizeof with_dead, "%s,%s", members, dead);
  kv_client *cb = kv_open(with_dead, &g, "connect_timeout_ms=500,peer_cooldown_ms=60000");
  enum { N = 32 };
  char names[N][32];
  const char *keys[N];
  unsigned char bufs[N][256];
  kv_iovec iov[N];
  size_t cnt[N], lens[N];
  int st[N];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "batch-%d", i);
    keys[i] = names[i];
    fill(bufs[i], sizeof bufs[i], (unsigned)i);
    iov[i].base = bufs[i];
    iov[i].len = sizeof bufs[i];
    cnt[i] = 1;
  }
  int ok = kv_batch_putv(cb, N, keys, iov, cnt, st);
  int dead_items = 0;
  for (int i = 0; i < N; i++) dead_items += st[i] == KV_UNAVAILABLE;
  CHECK(ok > 0 && dead_items > 0 && ok + dead_items == N, "batch put: %d ok, %d on the dead node", ok, dead_items);
  CHECK(strstr(kv_last_error(), "items not served") && strstr(kv_last_error(), "dead"),
        "the last error names the dead node: %s", kv_last_error());
  for (int i = 0; i < N; i++) memset(bufs[i], 0, sizeof bufs[i]);
  int gst[N];
  int gok = kv_batch_getv(cb, N, keys, iov, cnt, lens, gst);
  int same = 1;
  for (int i = 0; i < N; i++) {
    if (st[i] == KV_OK) {
      unsigned char want[256];
      fill(want, sizeof want, (unsigned)i);
      same &= gst[i] == KV_OK && lens[i] == 256 && memcmp(bufs[i], want, 256) == 0;
    } else {
      same &= gst[i] == KV_UNAVAILABLE;
    }
  }
  CHECK(gok == ok && same, "batch get matches the batch put (%d ok)", gok);
  int est[N];
  int eok = kv_batch_exist(cb, N, keys, est);
  int same_st = 1;
  for (int i = 0; i < N; i++) same_st &= est[i] == st[i];
  CHECK(eok == ok && same_st, "batch exist: %d ok, each status as the batch put's", eok);
  /* Overlapping output buffers are refused before any I/O. */
  kv_iovec ov[2] = {{bufs[0], 256}, {bufs[0] + 100, 256}};
  CHECK(kv_getv(cb, keys[0], ov, 2, lens) == KV_EINVAL && strstr(kv_last_error(), "overlap"), "overlapping iovecs refused");
  /* A batch delete: each status as the batch put's, then nothing left. */
  int delst[N];
  int dok = kv_batch_delete(cb, N, keys, delst);
  int same_del = 1;
  for (int i = 0; i < N; i++) same_del &= delst[i] == st[i];
  CHECK(dok == ok && same_del, "batch delete: %d removed, each status as the batch put's", dok);
  CHECK(kv_batch_exist(cb, N, keys, est) == 0, "nothing left after the batch delete");
  kv_close(cb);

  /* No member at all: unavailable, not a crash. */
  kv_client *none = kv_open("", &g, NULL);
  CHECK(none != NULL && kv_put(none, "k", src, 10) == KV_UNAVAILABLE && strstr(kv_last_error(), "no members"),
        "no node -> KV_UNAVAILABLE: %s", kv_last_error());
  kv_close(none);

  /* NULL and bad arguments. */
  CHECK(kv_open(NULL, &g, NULL) == NULL, "kv_open(NULL members)");
  CHECK(kv_open(members, NULL, NULL) == NULL, "kv_open(NULL geometry)");
  CHECK(kv_open(members, &g, "no_such_option=1") == NULL && strstr(kv_last_error(), "unknown option"),
        "unknown option refused: %s", kv_last_error());
  CHECK(kv_put(NULL, "k", src, 1) == KV_EINVAL, "put(NULL client)");
  CHECK(kv_put(c, NULL, src, 1) == KV_EINVAL, "put(NULL key)");
  CHECK(kv_put(c, "k", NULL, 5) == KV_EINVAL, "put(NULL buffer)");
  CHECK(kv_put(c, "", src, 1) == KV_EINVAL, "put(empty key)");
  CHECK(kv_get(c, "page-1", NULL, 10, &got) == KV_EINVAL, "get(NULL buffer)");
  CHECK(kv_getv(c, "page-1", NULL, 2, &got) == KV_EINVAL, "getv(NULL iov)");
  CHECK(kv_batch_exist(c, 2, NULL, st) == KV_EINVAL, "batch_exist(NULL keys)");
  CHECK(kv_batch_exist(c, 2, keys, NULL) == KV_EINVAL, "batch_exist(NULL out_status)");
  CHECK(kv_batch_delete(c, 2, NULL, st) == KV_EINVAL, "batch_delete(NULL keys)");
  CHECK(kv_batch_delete(c, 2, keys, NULL) == KV_EINVAL, "batch_delete(NULL out_status)");
  CHECK(kv_set_members(c, NULL) == KV_EINVAL, "set_members(NULL)");
  CHECK(kv_set_members(c, "garbage") == KV_EINVAL, "set_members(garbage)");
  CHECK(kv_exist(NULL, "k") == KV_EINVAL, "exist(NULL client)");
  CHECK(kv_epoch(NULL) == 0, "epoch(NULL)");
  /* The call bound is the thread's: set, read back as the previous one, cleared. */
  CHECK(kv_set_call_timeout_ms(250) == 0 && kv_set_call_timeout_ms(0) == 250, "call timeout round trip");
  CHECK(kv_start_mds_discovery(NULL, "127.0.0.1:1", "g", 100) == KV_EINVAL, "discovery(NULL client)");
  CHECK(kv_start_mds_discovery(c, NULL, "g", 100) == KV_EINVAL, "discovery(NULL endpoints)");
  CHECK(kv_start_mds_discovery(c, "127.0.0.1:1", NULL, 100) == KV_EINVAL, "discovery(NULL group)");
  CHECK(kv_start_mds_discovery(c, "127.0.0.1:1", "g", 0) == KV_EINVAL, "discovery(poll_ms 0)");
  CHECK(kv_start_mds_discovery(c, "not-an-endpoint", "g", 100) == KV_EINVAL, "discovery(bad endpoint)");
  CHECK(kv_start_mds_discovery(c, "127.0.0.1:1", "bad/group", 100) == KV_EINVAL, "discovery(bad group)");
  {
    /* No MDS listening: unavailable now, retried in the background; the
       static ring in use stays, and kv_close stops the discovery thread. */
    kv_client *d = kv_open(members, &g, NULL);
    uint64_t before = kv_epoch(d);
    CHECK(kv_start_mds_discovery(d, "127.0.0.1:1", "g", 100) == KV_UNAVAILABLE && strstr(kv_last_error(), "127.0.0.1:1"),
          "discovery with no MDS -> KV_UNAVAILABLE: %s", kv_last_error());
    CHECK(kv_epoch(d) == before && kv_exist(d, "page-1") == KV_OK, "the ring in use stays while no MDS answers");
    kv_close(d);
  }
  /* Per-item limits: an item's segments and a batch's items. */
  {
    size_t big = KV_MAX_ITEM_IOVCNT + 1;
    kv_iovec *many = calloc(big, sizeof *many);
    for (size_t i = 0; i < big; i++) { many[i].base = src + i; many[i].len = 1; }
    CHECK(kv_putv(c, "too-many-segments", many, big) == KV_EINVAL && strstr(kv_last_error(), "iovcnt"),
          "an item over KV_MAX_ITEM_IOVCNT segments: %s", kv_last_error());
    CHECK(kv_putv(c, "max-segments", many, KV_MAX_ITEM_IOVCNT) == KV_OK, "an item of exactly KV_MAX_ITEM_IOVCNT segments");
    free(many);
    const char *one = "k";
    CHECK(kv_batch_exist(c, (size_t)KV_MAX_BATCH_ITEMS + 1, &one, st) == KV_EINVAL && strstr(kv_last_error(), "batch of"),
          "a batch over KV_MAX_BATCH_ITEMS: %s", kv_last_error());
  }
  /* Lengths no buffer can have are refused before any view is made; an
     empty payload is a valid page. */
  {
    CHECK(kv_put(c, "huge", src, SIZE_MAX) == KV_EINVAL, "put of SIZE_MAX bytes: %s", kv_last_error());
    CHECK(kv_get(c, "page-1", dst, SIZE_MAX, &got) == KV_EINVAL, "get into a SIZE_MAX buffer: %s", kv_last_error());
    kv_iovec halves[2] = {{src, SIZE_MAX / 2 + 1}, {src, SIZE_MAX / 2 + 1}};
    CHECK(kv_putv(c, "huge2", halves, 2) == KV_EINVAL && strstr(kv_last_error(), "add up"),
          "segments whose lengths add up past isize: %s", kv_last_error());
    CHECK(kv_putv(c, "empty", NULL, 0) == KV_OK, "an item of 0 segments stores an empty page");
    CHECK(kv_get(c, "empty", dst, 0, &got) == KV_OK && got == 0, "and gets back 0 bytes (cap 0)");
    CHECK(kv_put(c, "empty2", NULL, 0) == KV_OK, "put(NULL, 0) is an empty page, not a NULL error");
    CHECK(kv_batch_exist(c, 0, NULL, NULL) == 0, "a batch of 0 items is 0 served");
  }
  /* kv_close racing calls on four other threads. */
  {
    kv_client *r = kv_open(members, &g, "io_timeout_ms=5000");
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, hammer, r);
    kv_close(r);
    int bad = 0;
    for (int i = 0; i < 4; i++) {
      void *res;
      pthread_join(th[i], &res);
      if (res == (void *)2) bad++;
    }
    CHECK(bad == 0 && kv_exist(r, "page-1") == KV_EINVAL, "kv_close racing calls on 4 threads");
  }
  /* The auth token option: a file that is missing or empty fails kv_open. */
  {
    CHECK(kv_open(members, &g, "auth_token_file=/nonexistent/token") == NULL &&
              strstr(kv_last_error(), "auth token file"),
          "kv_open with a missing token file: %s", kv_last_error());
    kv_client *tc = kv_open(members, &g, "auth_token_file=/proc/self/comm");
    CHECK(tc != NULL && kv_put(tc, "with-token", src, 10) == KV_OK,
          "a token is accepted by a node without one: %s", kv_last_error());
    kv_close(tc);
  }
  /* Delete at the owner; a second delete misses. */
  CHECK(kv_put(c, "delete-me", src, 100) == KV_OK && kv_delete(c, "delete-me") == KV_OK, "delete a stored key");
  CHECK(kv_exist(c, "delete-me") == KV_MISS && kv_delete(c, "delete-me") == KV_MISS, "deleted: exist and delete miss");
  CHECK(kv_delete(c, NULL) == KV_EINVAL && kv_delete(NULL, "k") == KV_EINVAL, "delete(NULL)");
  /* A closed handle is refused, never used: every call is KV_EINVAL. */
  {
    kv_client *gone = kv_open(members, &g, NULL);
    kv_close(gone);
    CHECK(kv_exist(gone, "page-1") == KV_EINVAL && strstr(kv_last_error(), "closed"), "exist on a closed handle: %s",
          kv_last_error());
    CHECK(kv_get(gone, "page-1", dst, n, &got) == KV_EINVAL && kv_put(gone, "k", src, 1) == KV_EINVAL &&
              kv_epoch(gone) == 0 && kv_stats_snapshot(gone, NULL, 0) == 0,
          "get, put, epoch and stats on a closed handle");
    kv_close(gone); /* twice: a no-op */
  }
  CHECK(kv_register_memory(c, src, n) == KV_OK, "register_memory is a no-op on TCP");
  CHECK(kv_register_memory(c, NULL, 10) == KV_EINVAL, "register_memory(NULL)");
  CHECK(kv_stats_snapshot(NULL, NULL, 0) == 0, "stats(NULL)");
  size_t need = kv_stats_snapshot(c, NULL, 0);
  char *text = malloc(need + 1);
  CHECK(need > 0 && kv_stats_snapshot(c, text, need + 1) == need && strstr(text, "kvclient_ops_total"),
        "stats snapshot (%zu bytes)", need);
  free(text);
  CHECK(kv_last_error() != NULL && kv_version() != NULL && strlen(kv_version()) > 0, "version %s", kv_version());
  kv_close(NULL);

  /* The page phase 2 finds damaged. */
  memset(src, 'Z', n);
  memcpy(src, "CORRUPT-ME-MARKER", 17);
  CHECK(kv_put(c, "corrupt-me", src, 64 * 1024) == KV_OK, "put corrupt-me");

  kv_close(c);
  free(src);
  free(dst);
  return failures ? 1 : 0;
}

static int phase_corrupt(const char *members) {
  kv_geometry g = geometry(42);
  kv_client *c = kv_open(members, &g, NULL);
  unsigned char *dst = malloc(64 * 1024);
  size_t got = 0;
  /* The node checks every disk read and drops the damaged record: a clean
     miss, and exist agrees (a page damaged in transit is the client's
     KV_CORRUPT, tested against a fake node in tests/tests/client.rs). */
  int s = kv_get(c, "corrupt-me", dst, 64 * 1024, &got);
  CHECK(s == KV_MISS, "a flipped payload byte on disk -> KV_MISS, never the page (got %d)", s);
  CHECK(kv_exist(c, "corrupt-me") == KV_MISS, "exist agrees the damaged page is gone");
  CHECK(kv_get(c, "page-1", dst, 64 * 1024, &got) == KV_TOO_SMALL, "the other pages still serve");
  kv_close(c);
  free(dst);
  return failures ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc >= 4 && strcmp(argv[1], "put") == 0) return phase_put(argv[2], argv[3]);
  if (argc >= 3 && strcmp(argv[1], "corrupt") == 0) return phase_corrupt(argv[2]);
  fprintf(stderr, "usage: abi_test put MEMBERS DEAD_MEMBER | abi_test corrupt MEMBERS\n");
  return 2;
}
