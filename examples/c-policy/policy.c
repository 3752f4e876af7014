//go:build ignore

// (The line above keeps the go tool from treating this directory as cgo.)

/*
 * A kvhost placement policy in C (ABI v1, docs/abi.md), built freestanding
 * for wasm32 with Debian's clang: no libc, no WASI, one import (kvhost.log).
 *
 *   naming    <fingerprint: 16 hex>/<key as hex>.kv on mount key_hash %
 *             mount_count: collision-free (the key itself is in the name),
 *             the same on every shard and after a restart (no ns, no state)
 *   tracking  a pool of entry nodes on one recency list, least recent
 *             first, and an open-addressing table from entry handle to node
 *   eviction  LRU: unpinned entries on the requested mount from the least
 *             recent, until their sizes cover the bytes asked for; the score
 *             is the last access time, comparable across shards
 *
 * Build (make wasm does it; scripts/ensure-clang.sh installs clang and lld):
 *
 *   clang --target=wasm32 -O2 -nostdlib -ffreestanding -mbulk-memory \
 *     -I sdk/c -Wl,--no-entry -o examples/c-policy/policy.wasm \
 *     examples/c-policy/policy.c
 *
 * Memory is static: MAX_ENTRIES nodes (48 bytes each) and a table of twice
 * as many slots. An insert beyond MAX_ENTRIES returns
 * KVHOST_STATUS_NO_MEMORY, a failure the host answers by switching to its
 * fallback policy when it repeats; size MAX_ENTRIES for your mounts (about
 * the files on all mounts divided by the shards, docs/abi.md).
 */
#include "kvhost_policy.h"

#define MAX_ENTRIES (1u << 17)         /* live entries per instance */
#define TABLE_SLOTS (2u * MAX_ENTRIES) /* power of two, load <= 50% */
#define NIL 0xFFFFFFFFu

/* The scratch area: a full batch of the largest record. */
static uint64_t scratch[KVHOST_SCRATCH_SIZE / sizeof(uint64_t)];

/* node is one entry; nodes are linked on the recency list, or on the free
 * list through next. */
typedef struct node {
	uint64_t id;
	uint64_t size;
	uint64_t time; /* last access, Unix nanoseconds */
	uint32_t prev, next;
	uint32_t pins;
	uint32_t mount;
} node;

static node nodes[MAX_ENTRIES];
static uint32_t table[TABLE_SLOTS]; /* node index + 1; 0 is an empty slot */
static uint32_t free_head = NIL;
static uint32_t unused; /* nodes never used yet start at this index */
static uint32_t head = NIL, tail = NIL; /* least and most recent */
static uint32_t live;

static void logf_s(int32_t level, const char *msg) {
	int32_t n = 0;
	while (msg[n]) n++;
	kvhost_log(level, msg, n);
}

/* ---- the table: handle -> node, linear probing, backward-shift delete. */

static uint32_t home(uint64_t id) {
	return (uint32_t)((id * UINT64_C(0x9E3779B97F4A7C15)) >> 32) & (TABLE_SLOTS - 1);
}

/* find returns the slot of id, or the empty slot where it would go. */
static uint32_t find(uint64_t id) {
	uint32_t i = home(id);
	while (table[i] != 0 && nodes[table[i] - 1].id != id) i = (i + 1) & (TABLE_SLOTS - 1);
	return i;
}

static void table_delete(uint32_t i) {
	uint32_t j = i;
	for (;;) {
		j = (j + 1) & (TABLE_SLOTS - 1);
		if (table[j] == 0) break;
		uint32_t h = home(nodes[table[j] - 1].id);
		/* Move j into the hole at i unless j's home lies in (i, j]. */
		if (((j - h) & (TABLE_SLOTS - 1)) >= ((j - i) & (TABLE_SLOTS - 1))) {
			table[i] = table[j];
			i = j;
		}
	}
	table[i] = 0;
}

/* ---- the recency list. */

static void unlink_node(uint32_t n) {
	node *e = &nodes[n];
	if (e->prev != NIL) nodes[e->prev].next = e->next; else head = e->next;
	if (e->next != NIL) nodes[e->next].prev = e->prev; else tail = e->prev;
	e->prev = e->next = NIL;
}

/* place links n by its time: from the tail back past every later node, so
 * that a RESTORE of an old entry lands where it belongs (touches, with the
 * latest time, stop at once). */
static void place(uint32_t n) {
	uint32_t after = tail;
	while (after != NIL && nodes[after].time > nodes[n].time) after = nodes[after].prev;
	nodes[n].prev = after;
	nodes[n].next = after == NIL ? head : nodes[after].next;
	if (nodes[n].next != NIL) nodes[nodes[n].next].prev = n; else tail = n;
	if (after != NIL) nodes[after].next = n; else head = n;
}

/* ---- hooks. */

KVHOST_EXPORT("kvhost_abi_version") int32_t kvhost_abi_version(void) { return KVHOST_ABI_VERSION; }

KVHOST_EXPORT("kvhost_features") int64_t kvhost_features(void) { return 0; }

KVHOST_EXPORT("kvhost_scratch") int32_t kvhost_scratch(int32_t min_bytes) {
	if (min_bytes < 0 || (uint32_t)min_bytes > sizeof scratch) return 0;
	return (int32_t)(uintptr_t)scratch;
}

/* kvhost_init accepts the host's keys (kvhost.*) and refuses any other:
 * this policy has no parameters, and a typo should fail at start. */
KVHOST_EXPORT("kvhost_init") int32_t kvhost_init(int32_t config_len) {
	const char *c = (const char *)scratch;
	if (config_len < 0 || config_len > KVHOST_MAX_CONFIG_LEN) return KVHOST_STATUS_INVALID_INPUT;
	for (int32_t i = 0; i < config_len;) {
		int32_t end = i;
		while (end < config_len && c[end] != '\n') end++;
		static const char host[] = "kvhost.";
		int32_t k = 0;
		while (k < 7 && i + k < end && c[i + k] == host[k]) k++;
		if (end > i && k < 7) {
			logf_s(KVHOST_LOG_ERROR, "c-policy: unknown configuration key (this policy takes none)");
			return KVHOST_STATUS_INVALID_INPUT;
		}
		i = end + 1;
	}
	return KVHOST_STATUS_OK;
}

KVHOST_EXPORT("kvhost_name") int32_t kvhost_name(int32_t n) {
	static const char hex[] = "0123456789abcdef";
	if (n < 0 || n > KVHOST_MAX_BATCH) return KVHOST_STATUS_INVALID_INPUT;
	kvhost_name_record *r = (kvhost_name_record *)scratch;
	for (int32_t i = 0; i < n; i++, r++) {
		if (r->mount_count == 0 || r->key_len == 0 || r->key_len > KVHOST_MAX_KEY_LEN) return KVHOST_STATUS_INVALID_INPUT;
		uint8_t *p = r->path;
		for (int s = 60; s >= 0; s -= 4) *p++ = hex[(r->fingerprint >> s) & 15];
		*p++ = '/';
		for (uint32_t k = 0; k < r->key_len; k++) {
			*p++ = hex[r->key[k] >> 4];
			*p++ = hex[r->key[k] & 15];
		}
		*p++ = '.', *p++ = 'k', *p++ = 'v';
		r->path_len = (uint32_t)(p - r->path); /* at most 16+1+128+3 = 148 */
		r->mount = (uint32_t)(r->key_hash % r->mount_count);
	}
	return KVHOST_STATUS_OK;
}

KVHOST_EXPORT("kvhost_access") int32_t kvhost_access(int32_t n) {
	if (n < 0 || n > KVHOST_MAX_BATCH) return KVHOST_STATUS_INVALID_INPUT;
	const kvhost_access_record *r = (const kvhost_access_record *)scratch;
	for (int32_t i = 0; i < n; i++, r++) {
		uint32_t slot = find(r->entry);
		uint32_t x = table[slot] ? table[slot] - 1 : NIL;
		switch (r->kind) {
		case KVHOST_ACCESS_INSERT:
		case KVHOST_ACCESS_RESTORE:
			if (x == NIL) {
				/* A new entry. */
				if (live == MAX_ENTRIES) {
					logf_s(KVHOST_LOG_ERROR, "c-policy: entry table full");
					return KVHOST_STATUS_NO_MEMORY;
				}
				if (free_head != NIL) x = free_head, free_head = nodes[x].next;
				else x = unused++;
				nodes[x] = (node){.id = r->entry, .prev = NIL, .next = NIL};
				table[slot] = x + 1;
				live++;
			} else {
				/* Known: an update, never a second entry; pins stay. */
				unlink_node(x);
			}
			nodes[x].size = r->size, nodes[x].mount = r->mount, nodes[x].time = r->time;
			place(x);
			break;
		case KVHOST_ACCESS_HIT:
			if (x != NIL) {
				unlink_node(x);
				if (r->time > nodes[x].time) nodes[x].time = r->time;
				place(x);
			}
			break;
		case KVHOST_ACCESS_PIN:
			if (x != NIL) nodes[x].pins++;
			break;
		case KVHOST_ACCESS_UNPIN:
			if (x != NIL && nodes[x].pins > 0) nodes[x].pins--;
			break;
		case KVHOST_ACCESS_REMOVE:
			if (x != NIL) {
				unlink_node(x);
				table_delete(slot);
				nodes[x].next = free_head, free_head = x;
				live--;
			}
			break;
		default:
			logf_s(KVHOST_LOG_ERROR, "c-policy: access kind not defined by ABI v1");
			return KVHOST_STATUS_INVALID_INPUT;
		}
	}
	return KVHOST_STATUS_OK;
}

KVHOST_EXPORT("kvhost_evict") int32_t kvhost_evict(int32_t max) {
	if (max < 0 || max > KVHOST_MAX_BATCH) return KVHOST_STATUS_INVALID_INPUT;
	const kvhost_evict_request *req = (const kvhost_evict_request *)scratch;
	kvhost_victim *out = (kvhost_victim *)((uint8_t *)scratch + KVHOST_VICTIMS_OFFSET);
	uint64_t freed = 0;
	int32_t count = 0;
	for (uint32_t x = head; x != NIL && count < max && freed < req->bytes; x = nodes[x].next) {
		const node *e = &nodes[x];
		if (e->pins != 0 || (req->mount != KVHOST_ANY_MOUNT && req->mount != e->mount)) continue;
		out[count].entry = e->id;
		out[count].score = e->time;
		count++;
		freed += e->size;
	}
	return count;
}
