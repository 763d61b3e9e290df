/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Every map of the object, and its options, in one place: the state the
 * programs share with each other and with user space (bistouri/bpf/handles.py opens
 * them by name, bistouri/bpf/loader.py sizes some before load and sets `cfg`).
 * Grouped by the part that uses them. Also the counters' helpers and the
 * ring's wakeup policy, which every part uses.
 *
 * Included once, by bistouri.bpf.c, after bistouri.h and unwind_rule.h (the
 * rule cache holds struct unwind_rule).
 */
#ifndef BISTOURI_MAPS_BPF_H
#define BISTOURI_MAPS_BPF_H

const volatile struct bistouri_config cfg = {
	.offcpu_min_ns = 1000,
	.offcpu_interval_ns = 10000000,
	.runqueue_interval_ns = 50000000,
	.wakeup_bytes = 128 << 10,
	.tp_btf_skip = 2,
};

/*
 * Ring-buffer records and enums have no map __type to keep them in BTF: these
 * globals anchor them, so abi.py (the one description user space reads) is
 * compared with them: struct sizes, field offsets and enum values.
 */
struct bistouri_exec_event abi_anchor_exec_event SEC(".bss");
struct bistouri_error_event abi_anchor_error_event SEC(".bss");
struct bistouri_raw_stack abi_anchor_raw_stack SEC(".bss");
enum bistouri_event_kind abi_anchor_event_kind SEC(".bss");
enum bistouri_filter_flags abi_anchor_filter_flags SEC(".bss");
enum bistouri_counter abi_anchor_counter SEC(".bss");
enum bistouri_cfa_kind abi_anchor_cfa_kind SEC(".bss");
enum bistouri_rbp_kind abi_anchor_rbp_kind SEC(".bss");
enum bistouri_ra_kind abi_anchor_ra_kind SEC(".bss");
enum bistouri_episode_kind abi_anchor_episode_kind SEC(".bss");
enum bistouri_thread_state abi_anchor_thread_state SEC(".bss");
enum bistouri_episode_counter abi_anchor_episode_counter SEC(".bss");
enum bistouri_episode_filter abi_anchor_episode_filter SEC(".bss");

/* ---- Filters, rings, counters and the samplers' state (bistouri.bpf.c, stack.bpf.h) ---- */

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

/* Stack events of every kind (struct bistouri_stack_event), drained by the ring thread. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 512 << 10); /* resized at load from CPUs x frequency */
} stack_events SEC(".maps");

/* Execs of comms matching a rule (struct bistouri_exec_event). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 << 10);
} exec_events SEC(".maps");

/* Losses the programs report with their reason (struct bistouri_error_event). */
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
 * the waits skipped since (their number and their time, each timed at its
 * end), which the next capture stands for: blocked time stays the real total,
 * not 1/600 of it in an fsync storm, and not a multiple of it either (a skip
 * too short to count as a wait is not counted).
 */
struct offcpu_limit {
	__u64 last_ns;
	__s64 skipped;
	__s64 skipped_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct offcpu_limit);
} offcpu_last SEC(".maps");

/*
 * tid -> when a wait the rate limit skipped began: timed at switch-in into
 * offcpu_last. A plain hash, as offcpu_pending: every switch-in on the host
 * looks it up, and an LRU lookup also writes.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u64);
} offcpu_skipped SEC(".maps");

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
 * A stack event is too large for the BPF stack: build it here. One slot per
 * context, as a perf sample may interrupt the sched_switch program on its CPU.
 */
#define SCRATCH_OFF_CPU 0
#define SCRATCH_ON_CPU 1
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} scratch SEC(".maps");

/*
 * Raw stack copies (struct bistouri_raw_stack) of the processes that ask for
 * them, drained with stack_events. Resized at load: a page unless the
 * profiler wants them (ProfilerOptions.raw_stacks, `record`'s).
 */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 2 << 20);
} raw_stacks SEC(".maps");

/*
 * Where a raw copy is built: the record, then a page of room, so that a page
 * read at any offset below BISTOURI_RAW_STACK_BYTES stays in the value (the
 * verifier checks the offset and size it can bound, not the loop's end).
 */
#define RAW_STACK_PAGE 4096
#define RAW_STACK_PAGES (BISTOURI_RAW_STACK_BYTES / RAW_STACK_PAGE + 1)

struct raw_scratch {
	struct bistouri_raw_stack raw;
	__u8 room[RAW_STACK_PAGE];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct raw_scratch);
} raw_scratch SEC(".maps");

/* Slot 0: handle_perf, once loaded, for handle_perf_fp to hand every sample on to. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} sampler_handoff SEC(".maps");

/* ---- The user-stack walk (unwind.bpf.h) ---- */

/*
 * Unwind tables (bistouri/unwind/tables.py loads them): the rows of every file with a
 * table, one range per file, and per process its mappings with tables. Sized at
 * load; user space evicts the least recently sampled files to stay within them.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 19);
	/* Written by a copy into a mapping of it: a batch update of a large binary's 600 000 rows
	 * took 0.13 s of CPU (0.26 s of wall) while its samples waited for them. */
	__uint(map_flags, BPF_F_MMAPABLE);
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
	__u32 slot;
	__u32 exact;
	__u32 mapping;
	__u32 reserved;
	struct unwind_rule rule; /* cfa_kind BISTOURI_CFA_NONE: no table covers ip */
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

/* ---- The episode hooks (episode.bpf.h) ---- */

/* tid -> the watched thread's time by state; user space reads it at the episode's end. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);                   /* tid */
	__type(value, struct bistouri_thread_times);
} thread_times SEC(".maps");

/* The episode hooks' own activity and loss counters (enum bistouri_episode_counter). */
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

/* tid -> stack taken when a reclaim or compaction began, sent when it ends. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} reclaim_pending SEC(".maps");

/* Where the episode hooks build a stack event (too large for the BPF stack). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bistouri_stack_event);
} episode_scratch SEC(".maps");

/* ---- CPython frames (python.bpf.h) ---- */

/* tgid -> its CPython description. Filled by user space when a target is a CPython process. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct bistouri_python_proc);
} python_procs SEC(".maps");

#define PY_READ_MAX 128 /* bytes of a frame or a code window read at once */
#define PY_STACK_WINDOW 4096 /* bytes of a thread's frame stack read at once (3.11+); a power of 2 */
#define PY_SEEN 8 /* code objects a walk remembers the checksum of (direct-mapped); a power of 2 */
#define PY_CODE_CACHE 256 /* checksums kept from sample to sample, per CPU and context (direct-mapped); a power of 2 */

/* A code object's checksum as read at a sample: valid while the process made no code object since. */
struct py_code_entry {
	__u64 code;
	__u64 counter_at;      /* the address of the count read (the thread's interpreter's, on 3.13) */
	__u32 owner;           /* bistouri_python_proc.owner */
	__u32 counter;         /* its value then */
	__u32 sum;
	__u32 reserved;
};

/*
 * A frame and a code object read whole, their fields then taken at masked offsets (+ 8: room for the
 * last); the newest PY_STACK_WINDOW bytes of the thread's frame stack (+ a frame's read past a masked
 * offset into it); the checksums of the code objects this walk read (seen_code 0: none), and of earlier
 * samples' (code_cache, see py_code_seen).
 */
struct py_scratch {
	__u8 frame[PY_READ_MAX + 8];
	__u8 code[PY_READ_MAX + 8];
	__u64 seen_code[PY_SEEN];
	__u32 seen_sum[PY_SEEN];
	struct py_code_entry code_cache[PY_CODE_CACHE];
	/* This walk's: its thread's data stack chunk and top (3.11+), its interpreter (3.13), and the
	 * count of code objects made (py_code_seen; 0: none, nothing kept from earlier samples). */
	__u64 ends[2];
	__u64 interp;
	__u64 counter_at;
	__u32 counter;
	__u32 reserved;
	__u8 stack[PY_STACK_WINDOW + PY_READ_MAX + 8];
};

/* Slot 0 for the perf_event program, 1 for the tracepoints (which it may interrupt): as stack_copies. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct py_scratch);
} py_scratch SEC(".maps");

enum bistouri_py_instr_kind abi_anchor_py_instr_kind SEC(".bss");
enum bistouri_py_entry_kind abi_anchor_py_entry_kind SEC(".bss");
enum bistouri_py_status abi_anchor_py_status SEC(".bss");

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

static __always_inline void count_add(__u32 which, __u64 n)
{
	__u64 *val = bpf_map_lookup_elem(&counters, &which);

	if (val)
		*val += n;
}

#endif /* BISTOURI_MAPS_BPF_H */
