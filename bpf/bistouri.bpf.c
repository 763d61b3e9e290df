// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Bistouri's BPF programs: on-CPU sampling, off-CPU (D-state) waits and exec
 * discovery. All three are blind until user space fills the maps: the pid
 * filter (which tgids to sample) and the comm trie (which comms to report
 * at exec).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "bistouri.h"
#include "core_fixes.bpf.h"

#define TASK_UNINTERRUPTIBLE 0x2
#define TASK_NOLOAD 0x400
#define KERNEL_STACK_BYTES (BISTOURI_MAX_DEPTH * sizeof(__u64))

const volatile struct bistouri_config cfg = {
	.offcpu_min_ns = 1000,
	.offcpu_interval_ns = 10000000,
	.runqueue_interval_ns = 50000000,
	.wakeup_bytes = 128 << 10,
	.tp_btf_skip = 2,
	.aggregate = 1,
};

/*
 * Ring-buffer records and enums have no map __type to keep them in BTF: these
 * globals anchor them, so abi.py (the one description user space reads) is
 * compared with them: struct sizes, field offsets and enum values.
 */
struct bistouri_exec_event abi_anchor_exec_event SEC(".bss");
struct bistouri_error_event abi_anchor_error_event SEC(".bss");
enum bistouri_event_kind abi_anchor_event_kind SEC(".bss");
enum bistouri_filter_flags abi_anchor_filter_flags SEC(".bss");
enum bistouri_counter abi_anchor_counter SEC(".bss");
enum bistouri_cfa_kind abi_anchor_cfa_kind SEC(".bss");
enum bistouri_rbp_kind abi_anchor_rbp_kind SEC(".bss");

/* tgid -> enum bistouri_filter_flags. Filled by the capture orchestrator. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
} pid_filter SEC(".maps");

/* comm prefix -> rule id. Exact rules include the NUL in prefixlen. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct bistouri_comm_key);
	__type(value, __u32);
} comm_rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 512 << 10); /* resized at load from CPUs x frequency */
} stack_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 << 10);
} exec_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 << 10);
} error_events SEC(".maps");

/*
 * tgid -> its VMA count when last sampled, and when a sample last woke user
 * space for a change. A changed count (a dlopen, an exec, JIT code) sends the
 * sample at once and wakes the reader, which re-reads /proc/PID/maps while the
 * process lives: one that dlopen()s and exits 100 ms later still gets named.
 */
struct map_seen {
	__u32 count;
	__u32 reserved;
	__u64 woke_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct map_seen);
} map_counts SEC(".maps");

#define MAP_WAKEUP_INTERVAL_NS 10000000ULL /* a process remapping all the time wakes the reader <= 100/s */

/* Loss and activity counters, read by the metrics collector at scrape time. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, BISTOURI_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* tid -> stack captured when the thread went to sleep, timed at switch-in. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} offcpu_pending SEC(".maps");

/*
 * tgid -> the per-process rate limit: time of the last off-CPU capture, and
 * the waits skipped since, which the next capture stands for (so blocked time
 * stays an estimate of the real total, not 1/600 of it in an fsync storm).
 */
struct offcpu_limit {
	__u64 last_ns;
	__s64 skipped;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct offcpu_limit);
} offcpu_last SEC(".maps");

/* Sample keys whose stacks user space holds (it deletes what it forgets). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct bistouri_sample_key);
	__type(value, __u8);
} known_samples SEC(".maps");

/*
 * Repeats of known samples counted since the last drain, by sample key; user
 * space reads and deletes them in batches. Preallocated: perf_event programs
 * may not allocate. Full: samples are sent whole instead, nothing is lost.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct bistouri_sample_key);
	__type(value, __u64);
} on_cpu_counts SEC(".maps");

/*
 * Unwind tables (bistouri/unwind.py loads them): the rows of every file with a
 * table, one range per file, and per process its mappings with tables. Sized at
 * load; user space evicts the least recently sampled files to stay within them.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 19);
	__type(key, __u32);
	__type(value, struct bistouri_unwind_row);
} unwind_rows SEC(".maps");

/* tgid -> its slot in unwind_mappings and how many mappings it has there. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, BISTOURI_UNWIND_PROCS);
	__type(key, __u32);
	__type(value, struct bistouri_unwind_proc);
} unwind_procs SEC(".maps");

/* BISTOURI_UNWIND_MAPPINGS entries per slot, sorted by start. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, BISTOURI_UNWIND_PROCS * BISTOURI_UNWIND_MAPPINGS);
	__type(key, __u32);
	__type(value, struct bistouri_unwind_mapping);
} unwind_mappings SEC(".maps");

/* A stack event is too large for the BPF stack: build it here (slot 0 off-CPU, 1 on-CPU). */
#define SCRATCH_OFF_CPU 0
#define SCRATCH_ON_CPU 1
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} scratch SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *val = bpf_map_lookup_elem(&counters, &which);

	if (val)
		*val += 1;
}

/* Counted first, so a loss is never silent even when the error ring is full too. */
static __always_inline void report_error(__u32 kind, __u32 pid, __s64 code)
{
	struct bistouri_error_event *err;

	count(kind);
	err = bpf_ringbuf_reserve(&error_events, sizeof(*err), 0);
	if (!err)
		return;
	err->kind = kind;
	err->pid = pid;
	err->code = code;
	err->timestamp_ns = bpf_ktime_get_ns();
	bpf_ringbuf_submit(err, 0);
}

/*
 * Wake the consumer only when enough data waits: the reader drains on a timer,
 * and one wakeup per sample costs ~10 us of its CPU (measured).
 */
static __always_inline __u64 wakeup_flags(void)
{
	if (bpf_ringbuf_query(&stack_events, BPF_RB_AVAIL_DATA) >= cfg.wakeup_bytes)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

/* FNV-1a over the first `bytes` of a stack of IPs (up to BISTOURI_MAX_DEPTH of them). */
static __always_inline __u64 hash_ips(const __u64 *ips, long bytes)
{
	__u64 h = 0xcbf29ce484222325ULL;

	for (int i = 0; i < BISTOURI_MAX_DEPTH; i++) {
		if ((long)(i * sizeof(__u64)) >= bytes) /* signed: a negative size (error) hashes nothing */
			break;
		h = (h ^ ips[i]) * 0x100000001b3ULL;
	}
	return h;
}

/* Registers a user walk starts from. */
struct user_regs {
	__u64 ip;
	__u64 sp;
	__u64 bp;
};

/*
 * The user stack is copied into a per-CPU buffer a chunk at a time as the walk
 * climbs it, and return addresses and saved RBPs are read from the copy: one
 * bpf_probe_read_user per frame was half of the walk's time (~90 ns each here:
 * a helper call, user-access barriers), a chunk of 1 KiB costs about as much as
 * one. Chunks are aligned so that none crosses a page: a chunk that cannot be
 * read (a page not present, the end of the stack's mapping) closes the copy and
 * the walk reads word by word from there. A word far above the copy, or past
 * STACK_WINDOW, starts a new copy at that word.
 */
#define STACK_CHUNK 1024
#define STACK_WINDOW (16 << 10)

struct stack_copy {
	__u8 bytes[STACK_WINDOW + 8]; /* + 8: a word read at any offset below STACK_WINDOW stays inside */
};

/* Slot 0 for the perf_event program, 1 for the tracepoints (which it may interrupt). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct stack_copy);
} stack_copies SEC(".maps");

/*
 * Where the walk is in the copy of the user stack, and one word to read from
 * it: stack_word() is a global function (verified once, on its own: inlined at
 * each read of walk_frame its branches multiplied the verifier's states past
 * its limit).
 */
struct stack_window {
	__u64 base;          /* user address of copy->bytes[0] */
	__u64 end;           /* bytes are copied up to this address */
	__u64 addr;          /* in: the word's address */
	__u64 word;          /* out */
	__u32 closed;        /* a chunk could not be read: no more copying */
	__u32 reserved;
};

/*
 * State of one user walk, carried from frame to frame by bpf_loop. Its layout
 * matters to the verifier, which tracks this stack 8 bytes at a time: with `n`
 * sharing a slot with a counter bumped at each frame, no two iterations' states
 * matched and it processed 840 k instructions (16 k as here). New fields go last.
 */
struct walk {
	struct user_regs regs;
	struct bistouri_stack_event *ev;
	struct stack_copy *copy;           /* the copy of the user stack that win describes */
	struct stack_window win;
	__u32 proc_slot;                   /* the process's slot of unwind_mappings */
	__u32 proc_count;                  /* its mappings with tables; 0: frame pointers only */
	__u32 last_mapping;                /* index in unwind_mappings of the previous frame's, or ~0 */
	__u32 n;                           /* frames written */
	__u32 by_table;
	__u32 by_fp;
	__u32 stop;                        /* enum bistouri_counter of why the walk ended; 0 while it goes on */
	bool exact;                        /* ip is where the thread was, not a return address */
	__u64 generation;                  /* unwind_generation when the walk began */
	__u32 cache_base;                  /* this context's half of rule_cache */
	__u32 cache_hits;
};

#define USER_TOP 0x7fffffffffffULL

/*
 * Binary searches below are unrolled steps (array lookups are inlined by the
 * verifier: a step is a few instructions), not bpf_loop callbacks: a helper call
 * per step was most of the walk's time. Only a row range wider than
 * UNROLLED_ROWS (a dense bucket) still goes through bpf_loop first.
 */
#define UNROLLED_ROWS 16

/* The last mapping starting at or before ip among a process's (sorted): 6 steps cover 64. */
#define MAPPING_STEP()                                                     \
	do {                                                               \
		if (lo + 1 < hi) {                                         \
			mid = lo + (hi - lo) / 2;                          \
			m = bpf_map_lookup_elem(&unwind_mappings, &mid);   \
			if (!m)                                            \
				return NULL;                               \
			if (m->start <= ip)                                \
				lo = mid;                                  \
			else                                               \
				hi = mid;                                  \
		}                                                          \
	} while (0)

static __always_inline struct bistouri_unwind_mapping *find_mapping(struct bistouri_unwind_proc *proc, __u64 ip,
								    __u32 *found)
{
	__u32 count = proc->count < BISTOURI_UNWIND_MAPPINGS ? proc->count : BISTOURI_UNWIND_MAPPINGS;
	__u32 lo = proc->slot * BISTOURI_UNWIND_MAPPINGS, hi = lo + count, mid;
	struct bistouri_unwind_mapping *m;

	if (!count)
		return NULL;
	MAPPING_STEP();
	MAPPING_STEP();
	MAPPING_STEP();
	MAPPING_STEP();
	MAPPING_STEP();
	MAPPING_STEP();
	m = bpf_map_lookup_elem(&unwind_mappings, &lo);
	if (!m || ip < m->start || ip >= m->end)
		return NULL;
	*found = lo;
	return m;
}

/* A binary search over unwind_rows, one step per bpf_loop callback (wide ranges only). */
struct row_search {
	__u32 lo;
	__u32 hi;
	__u32 pc;
};

static long row_search_step(__u32 index, void *data)
{
	struct row_search *s = data;
	struct bistouri_unwind_row *row;
	__u32 mid;

	if (s->lo + UNROLLED_ROWS >= s->hi)
		return 1;
	mid = s->lo + (s->hi - s->lo) / 2;
	row = bpf_map_lookup_elem(&unwind_rows, &mid);
	if (!row)
		return 1;
	if (row->pc <= s->pc)
		s->lo = mid;
	else
		s->hi = mid;
	return 0;
}

#define ROW_STEP()                                                         \
	do {                                                               \
		if (lo + 1 < hi) {                                         \
			mid = lo + (hi - lo) / 2;                          \
			row = bpf_map_lookup_elem(&unwind_rows, &mid);     \
			if (!row)                                          \
				return NULL;                               \
			if (row->pc <= pc)                                 \
				lo = mid;                                  \
			else                                               \
				hi = mid;                                  \
		}                                                          \
	} while (0)

/* The last row at or before pc among the mapping's rows, between two entries of its bucket index. */
static __always_inline struct bistouri_unwind_row *find_row(struct bistouri_unwind_mapping *m, __u32 pc)
{
	struct row_search s = { .lo = m->first, .hi = m->first + m->count, .pc = pc };
	struct bistouri_unwind_row *row;
	__u32 bucket = (pc >> (m->bucket_shift & 31)) - m->bucket_base;
	__u32 at, lo, hi, mid;

	if (!m->count)
		return NULL;
	if (pc >> (m->bucket_shift & 31) >= m->bucket_base && bucket < m->bucket_count) {
		at = m->buckets + bucket;
		row = bpf_map_lookup_elem(&unwind_rows, &at);
		if (row)
			s.lo = row->pc;
		at++;
		row = bpf_map_lookup_elem(&unwind_rows, &at);
		if (row)
			s.hi = row->pc + 1;
	}
	if (s.lo + UNROLLED_ROWS < s.hi)
		bpf_loop(24, row_search_step, &s, 0); /* tables hold < 2^24 rows */
	lo = s.lo;
	hi = s.hi;
	ROW_STEP();
	ROW_STEP();
	ROW_STEP();
	ROW_STEP();
	ROW_STEP();
	row = bpf_map_lookup_elem(&unwind_rows, &lo);
	if (!row || row->pc > pc)
		return NULL;
	return row;
}

/*
 * The unwind rule of one PC, as plain numbers. Filled by frame_rule(), a global
 * function: the verifier checks it once, on its own, instead of once per path
 * of walk_frame in each program (the searches' branches multiplied the states:
 * 450 k instructions processed and 1.2 s to load, against 3 k before the walk).
 */
struct frame_rule {
	__u64 ip;            /* in: the frame's PC */
	__u64 generation;    /* in: unwind_generation when the walk began */
	__u64 bias;          /* out: table pc = ip - bias */
	__u32 slot;          /* in: the process's slot of unwind_mappings */
	__u32 count;         /* in: its mappings */
	__u32 last_mapping;  /* in/out: index of the previous frame's mapping, ~0 if none */
	__u32 exact;         /* in: ip is where the thread was, not a return address */
	__u32 cache_base;    /* in: this context's first entry of rule_cache */
	__u32 cached;        /* out: the rule came from rule_cache */
	__s32 cfa_off;       /* out: the row, or cfa_kind NONE if no table covers ip */
	__s32 rbp_off;
	__u32 cfa_kind;
	__u32 rbp_kind;
};

/*
 * Recently found rules, per CPU: a walk meets the same return addresses at every
 * sample of a hot path (all of them in a recursion), and a hit skips the two
 * binary searches (~25 ns a frame here). An entry is a rule of (ip, process
 * slot, exact) as the tables were at its generation: user space bumps
 * unwind_generation after every change to the tables, which retires every
 * entry at once. Two halves, one per context, as stack_copies: a perf sample
 * may interrupt a tracepoint's walk on the same CPU.
 */
#define RULE_CACHE_ENTRIES 256

struct rule_cache_entry {
	__u64 ip;
	__u64 generation;
	__u64 bias;
	__u32 slot;
	__u32 exact;
	__u32 mapping;
	__u32 cfa_kind;
	__s32 cfa_off;
	__s32 rbp_off;
	__u32 rbp_kind;
	__u32 reserved;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2 * RULE_CACHE_ENTRIES);
	__type(key, __u32);
	__type(value, struct rule_cache_entry);
} rule_cache SEC(".maps");

/* One counter, starting at 1 (a zeroed cache entry never matches): see rule_cache. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} unwind_generation SEC(".maps");

/* The rule from the tables: global, verified on its own (its searches' branches would multiply frame_rule's states). */
__noinline int find_rule(struct frame_rule *r)
{
	struct bistouri_unwind_proc proc;
	struct bistouri_unwind_mapping *m = NULL;
	struct bistouri_unwind_row *row;
	__u32 last;
	__u64 pc;

	if (!r)
		return 0;
	r->cfa_kind = BISTOURI_CFA_NONE;
	last = r->last_mapping;
	if (last != ~0U) {
		/* Callers are often in the same file as their callee: try its mapping first. */
		m = bpf_map_lookup_elem(&unwind_mappings, &last);
		if (m && (r->ip < m->start || r->ip >= m->end))
			m = NULL;
	}
	if (!m) {
		proc.slot = r->slot;
		proc.count = r->count;
		m = find_mapping(&proc, r->ip, &r->last_mapping);
	}
	if (!m)
		return 0;
	/* A return address is past its call: look up the call itself. */
	pc = r->ip - m->bias - (r->exact ? 0 : 1);
	r->bias = m->bias;
	row = find_row(m, (__u32)pc);
	if (!row)
		return 0;
	r->cfa_kind = row->cfa_kind;
	r->cfa_off = row->cfa_off;
	r->rbp_kind = row->rbp_kind;
	r->rbp_off = row->rbp_off;
	return 1;
}

__noinline int frame_rule(struct frame_rule *r)
{
	struct rule_cache_entry *e;
	__u32 at;
	int found;

	if (!r)
		return 0;
	at = r->cache_base + ((__u32)(r->ip ^ (r->ip >> 8) ^ (r->ip >> 16)) & (RULE_CACHE_ENTRIES - 1));
	e = bpf_map_lookup_elem(&rule_cache, &at);
	if (e && e->ip == r->ip && e->generation == r->generation && e->slot == r->slot && e->exact == r->exact) {
		r->cfa_kind = e->cfa_kind;
		r->cfa_off = e->cfa_off;
		r->rbp_kind = e->rbp_kind;
		r->rbp_off = e->rbp_off;
		r->bias = e->bias;
		r->last_mapping = e->mapping;
		r->cached = 1;
		return e->cfa_kind != BISTOURI_CFA_NONE;
	}
	r->cached = 0;
	found = find_rule(r);
	if (e) {
		/* Misses too: a PC no table covers (JIT code) is as frequent as any. */
		e->ip = r->ip;
		e->generation = r->generation;
		e->slot = r->slot;
		e->exact = r->exact;
		e->mapping = r->last_mapping;
		e->cfa_kind = found ? r->cfa_kind : BISTOURI_CFA_NONE;
		e->cfa_off = r->cfa_off;
		e->rbp_kind = r->rbp_kind;
		e->rbp_off = r->rbp_off;
		e->bias = r->bias;
	}
	return found;
}

__noinline int stack_word(struct stack_copy *copy, struct stack_window *win)
{
	__u64 addr, off, size;

	if (!copy || !win)
		return -1;
	addr = win->addr;
	if (!(addr & 7)) {
		/*
		 * Far from the copy (a frame larger than two chunks, the interrupted
		 * stack of a signal handler on its own stack), or no room left for two
		 * chunks: start a new copy at the word.
		 */
		if (addr < win->base || addr >= win->end + 2 * STACK_CHUNK ||
		    (addr + 8 > win->end && win->end - win->base > STACK_WINDOW - 2 * STACK_CHUNK)) {
			win->base = win->end = addr;
			win->closed = 0;
		}
		/* Copy up to two more chunks if the word is just past the copy. */
		for (int i = 0; i < 2 && addr + 8 > win->end; i++) {
			off = win->end - win->base;
			if (win->closed || off > STACK_WINDOW - STACK_CHUNK || addr >= win->end + 2 * STACK_CHUNK)
				break;
			size = STACK_CHUNK - (win->end & (STACK_CHUNK - 1));
			if (bpf_probe_read_user(&copy->bytes[off], size, (void *)win->end)) {
				win->closed = 1;
				break;
			}
			win->end += size;
		}
		if (addr + 8 <= win->end) {
			win->word = *(__u64 *)&copy->bytes[(addr - win->base) & (STACK_WINDOW - 1)];
			return 0;
		}
	}
	return bpf_probe_read_user(&win->word, sizeof(win->word), (void *)addr);
}

/* One word of the user stack: from the copy when it holds it, else read on its own. */
static __always_inline long read_stack(struct walk *w, __u64 addr, __u64 *out)
{
	w->win.addr = addr;
	if (stack_word(w->copy, &w->win))
		return -1;
	*out = w->win.word;
	return 0;
}

/* One frame: record ip, then find the caller's ip, sp and bp. 1 ends the loop. */
static long walk_frame(__u32 index, void *data)
{
	struct walk *w = data;
	struct frame_rule r = { .last_mapping = ~0U };
	__u64 ip = w->regs.ip, sp = w->regs.sp, bp = w->regs.bp, cfa, ra = 0, saved_bp;
	__u32 kind = BISTOURI_CFA_NONE, rbp_kind = BISTOURI_RBP_UNCHANGED;
	__s32 cfa_off = 0, rbp_off = 0;
	__u64 bias = 0;

	if (w->n >= BISTOURI_MAX_DEPTH) {
		w->stop = BISTOURI_CNT_WALK_DEPTH;
		return 1;
	}
	w->ev->user_stack[w->n & 127] = ip;
	w->n++;

	if (w->proc_count) {
		r.ip = ip;
		r.slot = w->proc_slot;
		r.count = w->proc_count;
		r.last_mapping = w->last_mapping;
		r.exact = w->exact;
		r.generation = w->generation;
		r.cache_base = w->cache_base;
		if (frame_rule(&r)) {
			kind = r.cfa_kind;
			cfa_off = r.cfa_off;
			rbp_kind = r.rbp_kind;
			rbp_off = r.rbp_off;
			bias = r.bias;
		}
		w->last_mapping = r.last_mapping;
		w->cache_hits += r.cached;
	}
	w->exact = false;
	switch (kind) {
	case BISTOURI_CFA_RSP:
		cfa = sp + cfa_off;
		break;
	case BISTOURI_CFA_RBP:
		cfa = bp + cfa_off;
		break;
	case BISTOURI_CFA_PLT:
		cfa = sp + 8 + ((ip & 15) >= (__u64)cfa_off ? 8 : 0);
		break;
	case BISTOURI_CFA_TRAMPOLINE: {
		/* CPython's perf trampolines: sub $8,%rsp; call *%rcx; add $8,%rsp; ret, copied end to end. */
		__u64 at = cfa_off > 0 ? (ip - bias) % (__u32)cfa_off : 0;

		cfa = sp + 8 + (at >= (rbp_off & 0xff) && at < ((rbp_off >> 8) & 0xff) ? 8 : 0);
		rbp_kind = BISTOURI_RBP_UNCHANGED;
		break;
	}
	case BISTOURI_CFA_SIGNAL:
		/* RSP points at the ucontext: its mcontext holds the interrupted registers. */
		if (read_stack(w, sp + 168, &ra) || read_stack(w, sp + 160, &w->regs.sp) ||
		    read_stack(w, sp + 120, &w->regs.bp)) {
			w->stop = BISTOURI_CNT_WALK_READ_FAILED;
			return 1;
		}
		w->by_table++;
		w->regs.ip = ra;
		w->exact = true; /* the interrupted instruction itself */
		if (!ra) {
			w->stop = BISTOURI_CNT_WALK_END;
			return 1;
		}
		return 0;
	case BISTOURI_CFA_END:
		w->by_table++;
		w->stop = BISTOURI_CNT_WALK_END;
		return 1;
	default:
		/* No table here (JIT code, perf trampolines, a file not loaded yet): the frame pointer. */
		if (!bp) {
			w->stop = BISTOURI_CNT_WALK_NO_FP;
			return 1;
		}
		cfa = bp + 16;
		rbp_kind = BISTOURI_RBP_AT_CFA;
		rbp_off = -16;
		kind = BISTOURI_CFA_NONE;
		break;
	}
	if (cfa <= sp || cfa > USER_TOP) {
		w->stop = BISTOURI_CNT_WALK_BAD_FRAME;
		return 1;
	}
	if (read_stack(w, cfa - 8, &ra)) {
		w->stop = BISTOURI_CNT_WALK_READ_FAILED;
		return 1;
	}
	if (rbp_kind == BISTOURI_RBP_AT_CFA) {
		if (read_stack(w, cfa + rbp_off, &saved_bp)) {
			w->stop = BISTOURI_CNT_WALK_READ_FAILED;
			return 1;
		}
		w->regs.bp = saved_bp;
	}
	if (kind == BISTOURI_CFA_NONE)
		w->by_fp++;
	else
		w->by_table++;
	w->regs.ip = ra;
	w->regs.sp = cfa;
	if (!ra || ra > USER_TOP) {
		w->stop = ra ? BISTOURI_CNT_WALK_BAD_FRAME : BISTOURI_CNT_WALK_END;
		return 1;
	}
	return 0;
}

static __always_inline void count_add(__u32 which, __u64 n)
{
	__u64 *val = bpf_map_lookup_elem(&counters, &which);

	if (val)
		*val += n;
}

/*
 * The user stack as raw IPs, from .eh_frame tables where the process has them
 * and the frame pointer elsewhere. Returns the size in bytes, like bpf_get_stack.
 */
/* Inlined, not a global function: Debian's 6.1 verifier refuses the global version (EACCES). */
static __always_inline long walk_user(struct bistouri_stack_event *ev, struct user_regs *start, __u32 copy_slot)
{
	struct walk w = { .regs = *start, .ev = ev, .exact = true, .last_mapping = ~0U };
	struct bistouri_unwind_proc *proc;
	__u32 zero = 0;
	__u64 *generation;

	if (!start->ip || start->ip > USER_TOP)
		return 0;
	w.copy = bpf_map_lookup_elem(&stack_copies, &copy_slot);
	if (!w.copy)
		return 0;
	w.win.base = w.win.end = start->sp;
	proc = bpf_map_lookup_elem(&unwind_procs, &ev->pid);
	/* Read before the tables: a rule found while user space changes them is cached under the old one. */
	generation = bpf_map_lookup_elem(&unwind_generation, &zero);
	if (proc && generation) {
		w.proc_slot = proc->slot;
		w.proc_count = proc->count;
		w.generation = *generation;
		w.cache_base = copy_slot ? RULE_CACHE_ENTRIES : 0;
	}
	bpf_loop(BISTOURI_MAX_DEPTH + 1, walk_frame, &w, 0);
	count_add(BISTOURI_CNT_FRAMES_BY_TABLE, w.by_table);
	count_add(BISTOURI_CNT_FRAMES_BY_FP, w.by_fp);
	count_add(BISTOURI_CNT_RULE_CACHE_HITS, w.cache_hits);
	if (w.stop)
		count(w.stop);
	/* The same, per sample: the session says how its stacks were walked. */
	ev->user_by_table = w.by_table;
	ev->user_by_fp = w.by_fp;
	ev->user_walk_end = w.stop;
	return (long)w.n * sizeof(__u64);
}

/* Whether a perf sample interrupted user mode (pt_regs.cs); false without one. */
static __always_inline bool in_user_mode(struct bpf_perf_event_data *ctx)
{
	/* regs is the UAPI pt_regs at the context's start: a plain offset, not a CO-RE relocation. */
	return ctx && (((const __u64 *)ctx)[17] & 3) == 3;
}

/* The user registers of the current task: at the interrupt if it hit user mode, else at its kernel entry. */
static __always_inline bool user_regs_of(struct bpf_perf_event_data *ctx, struct user_regs *out)
{
	struct pt_regs *regs;

	if (in_user_mode(ctx)) {
		out->ip = ctx->regs.ip;
		out->sp = ctx->regs.sp;
		out->bp = ctx->regs.bp;
		return true;
	}
	regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
	if (!regs)
		return false;
	out->ip = BPF_CORE_READ(regs, ip);
	out->sp = BPF_CORE_READ(regs, sp);
	out->bp = BPF_CORE_READ(regs, bp);
	return true;
}

/*
 * `walk`: the user stack from the unwind tables (walk_user); false, the kernel's
 * frame-pointer walk, as walk_user does for a process without tables, in a
 * program the verifier checks in a fraction of the time (handle_perf_fp).
 */
static __always_inline void fill_stacks(void *ctx, struct bistouri_stack_event *ev,
					__u32 kernel_skip, struct bpf_perf_event_data *perf_ctx, bool walk)
{
	struct user_regs regs = {};
	struct bistouri_user_stack_key *key = &ev->user_key;
	struct mm_struct *mm;
	long n;

	/* A sample that hit user mode has no kernel stack: the helper would only say so. */
	if (in_user_mode(perf_ctx))
		n = 0;
	else
		n = bpf_get_stack(ctx, ev->kernel_stack, KERNEL_STACK_BYTES, kernel_skip & BPF_F_SKIP_FIELD_MASK);
	ev->kernel_stack_size = n;
	if (n < 0)
		report_error(BISTOURI_CNT_KERNEL_STACK_ERROR, ev->pid, n);
	ev->kernel_hash = hash_ips(ev->kernel_stack, n);

	/*
	 * Raw IPs only: the build-id walk (BPF_F_USER_BUILD_ID) cost ~8 us a new
	 * stack and fell back to bare IPs whenever the mmap lock was busy. User
	 * space maps the IPs to files from /proc/PID/maps instead.
	 */
	key->pid = ev->pid;
	key->reserved = 0;
	key->hash = 0;
	ev->user_by_table = 0;
	ev->user_by_fp = 0;
	ev->user_walk_end = 0;
	if (walk) {
		mm = BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), mm);
		key->mm = (__u64)mm;
		ev->map_count = mm ? BPF_CORE_READ(mm, map_count) : 0;
		/* Kernel threads have no user stack: not an error. */
		n = mm && user_regs_of(perf_ctx, &regs) ? walk_user(ev, &regs, perf_ctx ? 0 : 1) : 0;
	} else {
		/*
		 * No kernel struct read, so no CO-RE relocation: record loads this program
		 * without the kernel's BTF, which libbpf takes ~11 ms to parse. The address
		 * space and its mapping count stay 0 (unknown to user space).
		 */
		key->mm = 0;
		ev->map_count = 0;
		n = bpf_get_stack(ctx, ev->user_stack, sizeof(ev->user_stack), BPF_F_USER_STACK);
		if (n < 0) {
			report_error(BISTOURI_CNT_USER_STACK_ERROR, ev->pid, n);
			n = 0;
		}
		/* Each frame past the first was found by frame pointer; why the walk ended is unknown (0). */
		ev->user_by_fp = n > (long)sizeof(__u64) ? n / sizeof(__u64) - 1 : 0;
	}
	ev->user_stack_size = n;
	if (n <= 0)
		return;
	key->hash = hash_ips(ev->user_stack, n);
}

static __always_inline void fill_header(struct bistouri_stack_event *ev, __u32 kind,
					__u64 pid_tgid, __u64 now)
{
	ev->kind = kind;
	ev->pid = pid_tgid >> 32;
	ev->tid = (__u32)pid_tgid;
	ev->cpu = bpf_get_smp_processor_id();
	ev->timestamp_ns = now;
	ev->blocked_ns = 0;
	ev->waits = 1;
	bpf_get_current_comm(ev->comm, sizeof(ev->comm));
}

/*
 * Whether the sampled process's mappings changed since its last sample; if so,
 * also whether to wake the reader now (at most every MAP_WAKEUP_INTERVAL_NS).
 */
static __always_inline bool maps_changed(struct bistouri_stack_event *ev, bool *wake)
{
	struct map_seen *seen = bpf_map_lookup_elem(&map_counts, &ev->pid);
	struct map_seen fresh = { .count = ev->map_count, .woke_ns = ev->timestamp_ns };

	*wake = false;
	if (!seen) {
		/* Its first sample: the maps user space read may be older than this. */
		bpf_map_update_elem(&map_counts, &ev->pid, &fresh, BPF_ANY);
		*wake = true;
		count(BISTOURI_CNT_MAP_CHANGES);
		return true;
	}
	if (seen->count == ev->map_count)
		return false;
	seen->count = ev->map_count;
	if (ev->timestamp_ns - seen->woke_ns >= MAP_WAKEUP_INTERVAL_NS) {
		seen->woke_ns = ev->timestamp_ns;
		*wake = true;
	}
	count(BISTOURI_CNT_MAP_CHANGES);
	return true;
}

/* One on-CPU sample: `walk` as in fill_stacks. */
static __always_inline int sample_on_cpu(struct bpf_perf_event_data *ctx, bool walk)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	struct bistouri_sample_key key = {};
	struct bistouri_stack_event *ev;
	__u32 slot = SCRATCH_ON_CPU;
	__u64 zero = 0, *seen;
	bool marked = false, wake;
	__u8 one = 1;
	__u32 *flags, divisor;

	/* The filter comes first: this runs on every CPU at the sampling rate. */
	flags = bpf_map_lookup_elem(&pid_filter, &tgid);
	if (!flags || !(*flags & BISTOURI_FILTER_ON_CPU))
		return 0;
	divisor = (*flags >> BISTOURI_FILTER_DIVISOR_SHIFT) & 0xff;
	if (divisor > 1) {
		/* The flight recorder's rate: one sample in `divisor` of this process. */
		__sync_fetch_and_add(flags, 1U << BISTOURI_FILTER_SEEN_SHIFT);
		if ((*flags >> BISTOURI_FILTER_SEEN_SHIFT) % divisor)
			return 0;
	}

	ev = bpf_map_lookup_elem(&scratch, &slot);
	if (!ev)
		return 0;
	fill_header(ev, BISTOURI_EVENT_ON_CPU, pid_tgid, bpf_ktime_get_ns());
	fill_stacks(ctx, ev, 0, ctx, walk);
	count(BISTOURI_CNT_ON_CPU_SAMPLES);

	/*
	 * A repeat of a sample user space holds (same thread, kernel stack and
	 * user stack) only adds to a count: a CPU-bound loop then costs user
	 * space one event per distinct stack instead of one per sample.
	 */
	if (maps_changed(ev, &wake)) {
		/* Sent whole (not counted) and, unless it happens all the time, with a wakeup. */
		if (bpf_ringbuf_output(&stack_events, ev, sizeof(*ev), wake ? BPF_RB_FORCE_WAKEUP : wakeup_flags()))
			report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, tgid, 0);
		return 0;
	}
	if (cfg.aggregate) {
		key.tid = ev->tid;
		key.kernel_hash = ev->kernel_hash;
		key.user = ev->user_key;
		if (bpf_map_lookup_elem(&known_samples, &key)) {
			seen = bpf_map_lookup_elem(&on_cpu_counts, &key);
			if (!seen) {
				/* First repeat since the last drain (or another CPU's, if it won). */
				bpf_map_update_elem(&on_cpu_counts, &key, &zero, BPF_NOEXIST);
				seen = bpf_map_lookup_elem(&on_cpu_counts, &key);
			}
			if (seen) {
				__sync_fetch_and_add(seen, 1);
				return 0;
			}
			/* The count map is full: send this one whole. */
		} else {
			marked = !bpf_map_update_elem(&known_samples, &key, &one, BPF_ANY);
		}
	}
	if (bpf_ringbuf_output(&stack_events, ev, sizeof(*ev), wakeup_flags())) {
		report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, tgid, 0);
		if (marked) /* its repeats would have no stack to count into */
			bpf_map_delete_elem(&known_samples, &key);
	}
	return 0;
}

SEC("perf_event")
int handle_perf(struct bpf_perf_event_data *ctx)
{
	return sample_on_cpu(ctx, true);
}

/*
 * `record`'s first sampler (ProfilerOptions.sampler_first): frame pointers only,
 * so the verifier passes it in ~2 ms where handle_perf takes ~10, and nothing is
 * lost by that: a process's unwind tables are not loaded in its first tenth of a
 * second anyway. Once the companion object has loaded handle_perf, user space
 * puts it in sampler_handoff and every sample goes on there.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} sampler_handoff SEC(".maps");

SEC("perf_event")
int handle_perf_fp(struct bpf_perf_event_data *ctx)
{
	bpf_tail_call(ctx, &sampler_handoff, 0);
	return sample_on_cpu(ctx, false); /* slot 0 still empty */
}

/* The switched-in thread has a pending wait: time it and emit it. */
static __always_inline void finish_wait(struct task_struct *next, __u64 now)
{
	__u32 tid = BPF_CORE_READ(next, pid);
	struct bistouri_stack_event *pending;
	__u64 blocked;

	pending = bpf_map_lookup_elem(&offcpu_pending, &tid);
	if (!pending)
		return;
	blocked = now - pending->timestamp_ns;
	if (blocked < cfg.offcpu_min_ns) {
		count(BISTOURI_CNT_OFFCPU_TOO_SHORT);
	} else {
		pending->blocked_ns = blocked;
		if (bpf_ringbuf_output(&stack_events, pending, sizeof(*pending), wakeup_flags())) {
			report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, pending->pid, 0);
		} else
			count(BISTOURI_CNT_OFF_CPU_SAMPLES);
	}
	bpf_map_delete_elem(&offcpu_pending, &tid);
}

/* A filtered thread goes to sleep uninterruptibly: capture its stack now. */
static __always_inline void start_wait(void *ctx, struct task_struct *prev, __u64 now)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	__u32 tid = (__u32)pid_tgid;
	struct bistouri_stack_event *ev;
	struct offcpu_limit *limit;
	__u32 *flags, zero = 0;
	__s64 skipped = 0;
	long state;

	flags = bpf_map_lookup_elem(&pid_filter, &tgid);
	if (!flags || !(*flags & BISTOURI_FILTER_OFF_CPU))
		return;
	state = get_task_state(prev);
	if (!(state & TASK_UNINTERRUPTIBLE) || (state & TASK_NOLOAD))
		return;

	/*
	 * Rate limit per process before the expensive part: an fsync storm
	 * switches tens of thousands of times a second, and a build-id stack
	 * capture at each one took 22 % of a CPU (measured).
	 */
	limit = bpf_map_lookup_elem(&offcpu_last, &tgid);
	if (limit && now - limit->last_ns < cfg.offcpu_interval_ns) {
		__sync_fetch_and_add(&limit->skipped, 1);
		count(BISTOURI_CNT_OFFCPU_RATE_LIMITED);
		return;
	}
	if (limit) {
		/*
		 * Read, then subtract what was read: skips counted meanwhile on other
		 * CPUs stay for the next capture (plain XADD, no BPF v3 atomics). Two
		 * threads capturing at once may both subtract and leave the count
		 * negative: that is read as none until new skips fill the hole, so a
		 * race loses a few skips and never inflates a weight.
		 */
		skipped = *(volatile __s64 *)&limit->skipped;
		if (skipped > 0)
			__sync_fetch_and_add(&limit->skipped, -skipped);
		else
			skipped = 0;
		limit->last_ns = now;
	} else {
		struct offcpu_limit fresh = { .last_ns = now };

		bpf_map_update_elem(&offcpu_last, &tgid, &fresh, BPF_NOEXIST);
	}

	ev = bpf_map_lookup_elem(&scratch, &zero);
	if (!ev)
		return;
	fill_header(ev, BISTOURI_EVENT_OFF_CPU, pid_tgid, now);
	ev->waits = 1 + (__u32)(skipped < 0xfffffffeLL ? skipped : 0xfffffffeLL);
	fill_stacks(ctx, ev, cfg.tp_btf_skip, NULL, true);
	/* The wait starts now: the stack walk above is ours, not its. */
	ev->timestamp_ns = bpf_ktime_get_ns();
	if (bpf_map_update_elem(&offcpu_pending, &tid, ev, BPF_ANY))
		report_error(BISTOURI_CNT_OFFCPU_PENDING_FULL, tgid, 0);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_sched_switch, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	__u64 now = bpf_ktime_get_ns();

	/* In the tracepoint, current is still prev: its stack is the one to take. */
	if (!preempt)
		start_wait(ctx, prev, now);
	finish_wait(next, now);
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(handle_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	struct bistouri_comm_key key = { .prefixlen = BISTOURI_COMM_LEN * 8 };
	struct bistouri_exec_event *ev;
	__u32 *rule_id;

	/* The new comm is already set when the exec tracepoint fires. */
	bpf_get_current_comm(key.comm, sizeof(key.comm));
	rule_id = bpf_map_lookup_elem(&comm_rules, &key);
	if (!rule_id)
		return 0;

	ev = bpf_ringbuf_reserve(&exec_events, sizeof(*ev), 0);
	if (!ev) {
		report_error(BISTOURI_CNT_EXEC_RESERVE_FAILED, bpf_get_current_pid_tgid() >> 32, 0);
		return 0;
	}
	ev->rule_id = *rule_id;
	ev->pid = bpf_get_current_pid_tgid() >> 32;
	ev->cgroup_id = bpf_get_current_cgroup_id();
	__builtin_memcpy(ev->comm, key.comm, sizeof(ev->comm));
	count(BISTOURI_CNT_EXEC_MATCHES);
	bpf_ringbuf_submit(ev, 0);
	return 0;
}

/*
 * ---- Episode report (issue 12): victims' time by state. ----
 * Separate programs on the scheduler tracepoints, so the sampling code above
 * stays as it is. Every hook looks up the tgid in pid_filter first and returns
 * unless BISTOURI_EPISODE_FILTER_ON is set: an unwatched thread costs one hash lookup (none for the idle task).
 * State machine per thread, timed at each transition:
 *   switch-out: RUNNING -> RUNNABLE (preempted or still TASK_RUNNING), D or S
 *   wakeup:     D/S -> RUNNABLE (the wait ends: blocked time by state)
 *   switch-in:  RUNNABLE -> RUNNING (run-queue delay, as schedstat's run_delay)
 * Reclaim and compaction are timed begin -> end on the thread itself.
 *
 * Stacks of the waits, in wait_pending (tid -> stack), sent when the wait ends:
 *   S: taken at switch-out (per-thread rate limit), sent at wakeup as a SLEEP
 *      event; the same stack then waits for the CPU as a RUNQUEUE one.
 *   preempted: taken at switch-out (per-process rate limit) as a RUNQUEUE one.
 *   switch-in: a RUNQUEUE stack is sent weighted by the run-queue delay the
 *      thread accumulated since its last run-queue stack was sent (waits whose
 *      stack was rate limited, D wakeups, this one): the weights of a thread's
 *      run-queue stacks add up to its run-queue time, less what the last sent
 *      stack has not carried yet (runqueue_unsent_ns).
 */
#define TASK_INTERRUPTIBLE 0x1
#define TASK_DEAD 0x80

enum bistouri_episode_kind abi_anchor_episode_kind SEC(".bss");
enum bistouri_thread_state abi_anchor_thread_state SEC(".bss");
enum bistouri_episode_counter abi_anchor_episode_counter SEC(".bss");
enum bistouri_episode_filter abi_anchor_episode_filter SEC(".bss");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);                   /* tid */
	__type(value, struct bistouri_thread_times);
} thread_times SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, BISTOURI_EPC_MAX);
	__type(key, __u32);
	__type(value, __u64);
} episode_counters SEC(".maps");

/*
 * tid -> stack taken when a sleep (S) began or the thread was preempted, sent
 * when the wait ends: a thread is either asleep or runnable, never both.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} wait_pending SEC(".maps");

/* tgid -> when its last run-queue stack was taken (the per-process rate limit). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u64);
} runqueue_last SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} reclaim_pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} episode_scratch SEC(".maps");

static __always_inline void episode_count(__u32 which)
{
	__u64 *val = bpf_map_lookup_elem(&episode_counters, &which);

	if (val)
		*val += 1;
}

static __always_inline bool episode_watched(__u32 tgid)
{
	__u32 *flags;

	if (!tgid) /* the idle task: half of all switches on a quiet CPU */
		return false;
	flags = bpf_map_lookup_elem(&pid_filter, &tgid);

	return flags && (*flags & BISTOURI_EPISODE_FILTER_ON);
}

/* The thread's times, created (state unknown) on first sight; NULL if the map refuses. */
static __always_inline struct bistouri_thread_times *thread_entry(__u32 tgid, __u32 tid,
								  struct task_struct *task)
{
	struct bistouri_thread_times *t = bpf_map_lookup_elem(&thread_times, &tid);
	struct bistouri_thread_times fresh = { .pid = tgid, .tid = tid };

	if (t && t->pid == tgid)
		return t;
	/* New, or its tid now belongs to another process: start over. */
	BPF_CORE_READ_STR_INTO(&fresh.comm, task, comm);
	if (bpf_map_update_elem(&thread_times, &tid, &fresh, BPF_ANY)) {
		episode_count(BISTOURI_EPC_THREADS_FULL);
		return NULL;
	}
	return bpf_map_lookup_elem(&thread_times, &tid);
}

/*
 * A run-queue wait of `delay` ns ends: add it to what the thread's run-queue
 * stacks have not carried yet and, if it has one pending, send it carrying all
 * of that (blocked_ns the mean of those waits, `waits` their number). A stack
 * that cannot be sent leaves its time to the next one. Called wherever
 * runqueue_ns grows, so sent + unsent is the thread's run-queue time.
 */
static __always_inline void runqueue_done(struct bistouri_thread_times *t, __u64 delay)
{
	struct bistouri_stack_event *pending;
	__u32 tid = t->tid, waits;

	t->runqueue_unsent_ns += delay;
	t->runqueue_unsent += 1;
	pending = bpf_map_lookup_elem(&wait_pending, &tid);
	if (!pending)
		return;
	if (pending->kind == BISTOURI_EVENT_RUNQUEUE) {
		waits = t->runqueue_unsent;
		pending->waits = waits;
		pending->blocked_ns = t->runqueue_unsent_ns / (waits ? waits : 1);
		if (bpf_ringbuf_output(&stack_events, pending, sizeof(*pending), wakeup_flags())) {
			report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, pending->pid, 0);
		} else {
			t->runqueue_unsent_ns -= pending->blocked_ns * waits;
			t->runqueue_unsent = 0;
			episode_count(BISTOURI_EPC_RUNQUEUE_STACKS);
		}
	}
	bpf_map_delete_elem(&wait_pending, &tid);
}

/* Close the state the thread was in at `now`: add its time where it belongs. */
static __always_inline void close_state(struct bistouri_thread_times *t, __u64 now)
{
	__u64 d = t->since_ns && now > t->since_ns ? now - t->since_ns : 0;

	switch (t->state) {
	case BISTOURI_STATE_RUNNING:
		t->on_cpu_ns += d;
		break;
	case BISTOURI_STATE_RUNNABLE:
		t->runqueue_ns += d;
		t->runqueue_waits += 1;
		runqueue_done(t, d);
		break;
	case BISTOURI_STATE_BLOCKED_D:
		t->blocked_d_ns += d;
		t->d_waits += 1;
		break;
	case BISTOURI_STATE_BLOCKED_S:
		t->blocked_s_ns += d;
		t->s_waits += 1;
		break;
	}
}

/* A pending stack (sleep or reclaim) of `tid` ends now: send it with its duration. */
static __always_inline void send_pending(void *map, __u32 tid, __u64 now)
{
	struct bistouri_stack_event *pending = bpf_map_lookup_elem(map, &tid);

	if (!pending)
		return;
	pending->blocked_ns = now > pending->timestamp_ns ? now - pending->timestamp_ns : 0;
	if (bpf_ringbuf_output(&stack_events, pending, sizeof(*pending), wakeup_flags()))
		report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, pending->pid, 0);
	bpf_map_delete_elem(map, &tid);
}

/*
 * The waits a sleep or reclaim stack taken now stands for (1 + the ones the
 * per-thread rate limit skipped since the last), or 0: at most one stack per
 * offcpu_interval_ns per thread.
 */
static __always_inline __u32 stack_due(struct bistouri_thread_times *t, __u64 now)
{
	__u32 waits;

	if (t->stack_ns && now - t->stack_ns < cfg.offcpu_interval_ns) {
		t->skipped += 1;
		episode_count(BISTOURI_EPC_STACKS_LIMITED);
		return 0;
	}
	waits = 1 + t->skipped;
	t->skipped = 0;
	t->stack_ns = now;
	return waits;
}

/*
 * Whether a run-queue stack of `tgid` is due: at most one per
 * runqueue_interval_ns per process. A CPU-bound process on a crowded machine
 * is preempted at every tick: each stack sent costs user space a decoded
 * record, and a thread preempted in between has no stack of its own, its delay
 * goes to its next one (the totals stay exact; only the stacks are fewer).
 */
static __always_inline bool runqueue_stack_due(__u32 tgid, __u64 now)
{
	__u64 *last = bpf_map_lookup_elem(&runqueue_last, &tgid);

	if (last && now - *last < cfg.runqueue_interval_ns) {
		episode_count(BISTOURI_EPC_STACKS_LIMITED);
		return false;
	}
	if (last)
		*last = now;
	else
		bpf_map_update_elem(&runqueue_last, &tgid, &now, BPF_ANY);
	return true;
}

/* Take the current thread's stack into `map` (tid -> stack) for a wait of `kind` starting now. */
static __always_inline void take_stack(void *ctx, void *map, __u32 kind, __u32 waits, __u64 now)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid, zero = 0;
	struct bistouri_stack_event *ev;

	ev = bpf_map_lookup_elem(&episode_scratch, &zero);
	if (!ev)
		return;
	fill_header(ev, kind, pid_tgid, now);
	ev->waits = waits;
	fill_stacks(ctx, ev, cfg.tp_btf_skip, NULL, true);
	ev->timestamp_ns = bpf_ktime_get_ns(); /* the wait starts now: the walk above is ours */
	if (bpf_map_update_elem(map, &tid, ev, BPF_ANY))
		report_error(BISTOURI_CNT_OFFCPU_PENDING_FULL, ev->pid, 0);
}

/* A sleep of `tid` ends (woken at `now`): send its stack, which then waits for a CPU. */
static __always_inline void sleep_woken(__u32 tid, __u64 now)
{
	struct bistouri_stack_event *pending = bpf_map_lookup_elem(&wait_pending, &tid);

	if (!pending || pending->kind != BISTOURI_EVENT_SLEEP)
		return;
	pending->blocked_ns = now > pending->timestamp_ns ? now - pending->timestamp_ns : 0;
	if (bpf_ringbuf_output(&stack_events, pending, sizeof(*pending), wakeup_flags()))
		report_error(BISTOURI_CNT_STACK_RESERVE_FAILED, pending->pid, 0);
	pending->kind = BISTOURI_EVENT_RUNQUEUE;
	pending->timestamp_ns = now;
	pending->waits = 1;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(handle_episode_switch, bool preempt, struct task_struct *prev,
	     struct task_struct *next)
{
	struct bistouri_thread_times *t;
	__u32 tgid, tid, take = 0, waits = 1;
	__u64 now = 0;
	long state;

	/* prev is current: account its CPU time and the state it leaves in. */
	tgid = BPF_CORE_READ(prev, tgid);
	if (episode_watched(tgid)) {
		now = bpf_ktime_get_ns(); /* only for watched threads: the rest pay two lookups */
		tid = BPF_CORE_READ(prev, pid);
		t = thread_entry(tgid, tid, prev);
		if (t) {
			episode_count(BISTOURI_EPC_SWITCHES);
			close_state(t, now);
			state = get_task_state(prev);
			if (state & TASK_DEAD) {
				/* Its last switch: nothing more to time (the entry stays for the final read). */
				t->state = BISTOURI_STATE_UNKNOWN;
			} else if (preempt || state == 0) {
				t->state = BISTOURI_STATE_RUNNABLE;
				if (runqueue_stack_due(tgid, now))
					take = BISTOURI_EVENT_RUNQUEUE;
			} else if ((state & TASK_UNINTERRUPTIBLE) && !(state & TASK_NOLOAD)) {
				t->state = BISTOURI_STATE_BLOCKED_D;
			} else {
				/* TASK_INTERRUPTIBLE, or an idle (NOLOAD) wait: not a D stall. */
				t->state = BISTOURI_STATE_BLOCKED_S;
				if (state & TASK_INTERRUPTIBLE) {
					waits = stack_due(t, now);
					if (waits)
						take = BISTOURI_EVENT_SLEEP;
				}
			}
			t->since_ns = now;
			/* One call site: the stack walk is inlined once in this program. */
			if (take)
				take_stack(ctx, &wait_pending, take, waits, now);
		}
	}

	tgid = BPF_CORE_READ(next, tgid);
	if (!episode_watched(tgid))
		return 0;
	if (!now)
		now = bpf_ktime_get_ns();
	tid = BPF_CORE_READ(next, pid);
	t = thread_entry(tgid, tid, next);
	if (!t)
		return 0;
	if (t->state == BISTOURI_STATE_BLOCKED_S)
		send_pending(&wait_pending, tid, now); /* woken without a wakeup we saw */
	if (t->state != BISTOURI_STATE_UNKNOWN)
		close_state(t, now);
	t->state = BISTOURI_STATE_RUNNING;
	t->since_ns = now;
	return 0;
}

static __always_inline void episode_wakeup(struct task_struct *p, bool new_task)
{
	__u32 tgid = BPF_CORE_READ(p, tgid), tid;
	struct bistouri_thread_times *t;
	__u64 now;

	if (!episode_watched(tgid))
		return;
	now = bpf_ktime_get_ns();
	tid = BPF_CORE_READ(p, pid);
	t = thread_entry(tgid, tid, p);
	if (!t)
		return;
	if (t->state == BISTOURI_STATE_RUNNING || t->state == BISTOURI_STATE_RUNNABLE)
		return; /* already counted as wanting a CPU */
	episode_count(BISTOURI_EPC_WAKEUPS);
	if (t->state == BISTOURI_STATE_BLOCKED_S)
		sleep_woken(tid, now);
	if (t->state != BISTOURI_STATE_UNKNOWN && !new_task)
		close_state(t, now);
	t->state = BISTOURI_STATE_RUNNABLE;
	t->since_ns = now;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(handle_episode_wakeup, struct task_struct *p)
{
	episode_wakeup(p, false);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(handle_episode_wakeup_new, struct task_struct *p)
{
	episode_wakeup(p, true);
	return 0;
}

/* Reclaim and compaction run on the stalled thread itself: current. */
static __always_inline void reclaim_begin(void *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct bistouri_thread_times *t;
	__u32 waits;
	__u64 now;

	if (!episode_watched(tgid))
		return;
	t = thread_entry(tgid, tid, (struct task_struct *)bpf_get_current_task());
	if (!t || t->reclaim_start_ns)
		return; /* nested (compaction inside reclaim): the outer one is timed */
	now = bpf_ktime_get_ns();
	t->reclaim_start_ns = now;
	waits = stack_due(t, now);
	if (waits)
		take_stack(ctx, &reclaim_pending, BISTOURI_EVENT_RECLAIM, waits, now);
}

static __always_inline void reclaim_end(void)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct bistouri_thread_times *t;
	__u64 now;

	if (!episode_watched(tgid))
		return;
	t = bpf_map_lookup_elem(&thread_times, &tid);
	if (!t || !t->reclaim_start_ns)
		return;
	now = bpf_ktime_get_ns();
	t->reclaim_ns += now - t->reclaim_start_ns;
	t->reclaims += 1;
	t->reclaim_start_ns = 0;
	episode_count(BISTOURI_EPC_RECLAIMS);
	send_pending(&reclaim_pending, tid, now);
}

SEC("tp_btf/mm_vmscan_direct_reclaim_begin")
int BPF_PROG(handle_direct_reclaim_begin)
{
	reclaim_begin(ctx);
	return 0;
}

SEC("tp_btf/mm_vmscan_direct_reclaim_end")
int BPF_PROG(handle_direct_reclaim_end)
{
	reclaim_end();
	return 0;
}

/* memory.high and memory.max make the allocating thread reclaim its own cgroup. */
SEC("tp_btf/mm_vmscan_memcg_reclaim_begin")
int BPF_PROG(handle_memcg_reclaim_begin)
{
	reclaim_begin(ctx);
	return 0;
}

SEC("tp_btf/mm_vmscan_memcg_reclaim_end")
int BPF_PROG(handle_memcg_reclaim_end)
{
	reclaim_end();
	return 0;
}

SEC("tp_btf/mm_compaction_begin")
int BPF_PROG(handle_compaction_begin)
{
	reclaim_begin(ctx);
	return 0;
}

SEC("tp_btf/mm_compaction_end")
int BPF_PROG(handle_compaction_end)
{
	reclaim_end();
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
