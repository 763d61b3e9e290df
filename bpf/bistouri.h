/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Structures shared between the BPF programs and the Python agent.
 *
 * Every struct here has a ctypes mirror in bistouri/bpf/abi.py. tests/bpf/test_abi.py
 * compares sizes and field offsets of the mirrors with the BTF of the built
 * object, so a field added on one side only fails the test suite.
 * Fixed-width types and explicit padding only: the layout must not depend on
 * the compiler.
 */
#ifndef BISTOURI_H
#define BISTOURI_H

#ifndef BISTOURI_COMM_LEN
#define BISTOURI_COMM_LEN 16      /* TASK_COMM_LEN, including the NUL */
#endif
#ifndef BISTOURI_MAX_DEPTH
#define BISTOURI_MAX_DEPTH 127    /* PERF_MAX_STACK_DEPTH */
#endif

/* What a stack_event is. */
enum bistouri_event_kind {
	BISTOURI_EVENT_ON_CPU = 1,  /* perf cpu-clock sample */
	BISTOURI_EVENT_OFF_CPU = 2, /* uninterruptible wait, timed at switch-in */
};

/*
 * The pid filter value: what to capture for a tgid (bits 0-7), one on-CPU
 * sample kept in `divisor` (bits 8-15; 0 or 1: all, the flight recorder's lower
 * rate otherwise), and the samples seen so far (bits 16-31, counted by BPF).
 */
enum bistouri_filter_flags {
	BISTOURI_FILTER_ON_CPU = 1,
	BISTOURI_FILTER_OFF_CPU = 2,
	/* On-CPU samples whose user walk is cut short are also sent as raw stack copies
	 * (struct bistouri_raw_stack), walked by user space once the tables are in. */
	BISTOURI_FILTER_RAW_STACK = 8,
	/* Only the flight recorder watches the process (no session samples it): its waits are
	 * counted in recorder_waits, not sent (recorder.bpf.h). */
	BISTOURI_FILTER_RECORDED = 16,
};
#define BISTOURI_FILTER_DIVISOR_SHIFT 8
#define BISTOURI_FILTER_SEEN_SHIFT 16

/* Kinds of error_event; also indexes of the per-CPU counters map. */
enum bistouri_counter {
	BISTOURI_CNT_STACK_RESERVE_FAILED = 0, /* stack ring full: sample lost */
	BISTOURI_CNT_EXEC_RESERVE_FAILED = 1,  /* exec ring full: discovery lost */
	BISTOURI_CNT_KERNEL_STACK_ERROR = 2,   /* bpf_get_stack(kernel) < 0 */
	BISTOURI_CNT_USER_STACK_ERROR = 3,     /* bpf_get_stack(user) < 0 */
	BISTOURI_CNT_OFFCPU_PENDING_FULL = 4,  /* too many threads blocked at once */
	BISTOURI_CNT_OFFCPU_RATE_LIMITED = 5,  /* wait skipped by the rate limit */
	BISTOURI_CNT_OFFCPU_TOO_SHORT = 6,     /* wait shorter than offcpu_min_ns */
	BISTOURI_CNT_ON_CPU_SAMPLES = 7,       /* samples emitted */
	BISTOURI_CNT_OFF_CPU_SAMPLES = 8,      /* off-CPU waits emitted */
	BISTOURI_CNT_EXEC_MATCHES = 9,         /* exec events emitted */
	BISTOURI_CNT_MAP_CHANGES = 10,         /* samples sent at once: their process's mappings changed */
	BISTOURI_CNT_FRAMES_BY_TABLE = 11,     /* user frames unwound from an .eh_frame table */
	BISTOURI_CNT_FRAMES_BY_FP = 12,        /* user frames unwound by the frame pointer (no table covers the PC) */
	BISTOURI_CNT_WALK_END = 13,            /* walks that reached the outermost frame (return address undefined or 0) */
	BISTOURI_CNT_WALK_NO_FP = 14,          /* walks stopped at a PC with no table and no frame pointer */
	BISTOURI_CNT_WALK_READ_FAILED = 15,    /* walks stopped: the stack could not be read (paged out, bad CFA) */
	BISTOURI_CNT_WALK_DEPTH = 16,          /* walks stopped at BISTOURI_MAX_DEPTH frames */
	BISTOURI_CNT_WALK_BAD_FRAME = 17,      /* walks stopped: the next frame is not above this one on the stack */
	BISTOURI_CNT_RULE_CACHE_HITS = 18,     /* user frames whose unwind rule came from the per-CPU rule cache */
	BISTOURI_CNT_RAW_STACKS = 19,          /* samples sent as raw stack copies (BISTOURI_FILTER_RAW_STACK) */
	BISTOURI_CNT_RAW_STACK_LOST = 20,      /* raw stack copies lost to a full raw_stacks ring: sent as walked */
	BISTOURI_CNT_MAX = 21,
};

/* How a row finds the CFA (bistouri/unwind/ehframe.py CfaKind). */
enum bistouri_cfa_kind {
	BISTOURI_CFA_NONE = 0,   /* no CFI covers the PC: frame pointer */
	BISTOURI_CFA_RSP = 1,    /* CFA = RSP + cfa_off */
	BISTOURI_CFA_RBP = 2,    /* CFA = RBP + cfa_off */
	BISTOURI_CFA_PLT = 3,    /* .plt entry: RSP + 8, + 8 when (RIP & 15) >= cfa_off */
	BISTOURI_CFA_SIGNAL = 4, /* signal trampoline: registers in the ucontext at RSP */
	BISTOURI_CFA_OTHER = 5,  /* an expression the walk cannot evaluate: frame pointer */
	BISTOURI_CFA_END = 6,    /* outermost frame (return address undefined) */
	BISTOURI_CFA_TRAMPOLINE = 7, /* copies of a cfa_off-byte trampoline: RSP + 16 in [rbp_off & 0xff, rbp_off >> 8), else RSP + 8 */
};

/* Where the caller's RBP is (bistouri/unwind/ehframe.py RbpKind). */
enum bistouri_rbp_kind {
	BISTOURI_RBP_UNCHANGED = 0,
	BISTOURI_RBP_AT_CFA = 1, /* saved at CFA + rbp_off */
	BISTOURI_RBP_OTHER = 2,  /* unknown: the caller's RBP is taken as unchanged */
};

/*
 * Where the return address is, in bits 2-3 of a row's rbp_kind byte (the low
 * two are enum bistouri_rbp_kind): always 0 on x86-64, where the call pushed it
 * at CFA - 8. On aarch64 "RBP" is x29 and the return address is the link
 * register x30 until a prologue saves it (bistouri/unwind/cfa.py RaKind).
 */
enum bistouri_ra_kind {
	BISTOURI_RA_CFA = 0,    /* x86-64: CFA - 8; aarch64: CFA + rbp_off + 8 (stp x29, x30) */
	BISTOURI_RA_LR = 1,     /* aarch64: still in x30 (a leaf, or before the prologue saved it) */
	BISTOURI_RA_AT_OFF = 2, /* aarch64: saved alone at CFA + rbp_off, x29 unchanged */
};
#define BISTOURI_RBP_KIND_MASK 3
#define BISTOURI_RA_KIND_SHIFT 2

#ifndef BISTOURI_UNWIND_MAPPINGS
#define BISTOURI_UNWIND_MAPPINGS 64 /* mappings with a table per process */
#endif
#ifndef BISTOURI_UNWIND_PROCS
#define BISTOURI_UNWIND_PROCS 512   /* processes with tables at once */
#endif

/* One row of an unwind table: from pc (file virtual address) to the next row. */
struct bistouri_unwind_row {
	__u32 pc;
	__s32 cfa_off;
	__s16 rbp_off;
	__u8 cfa_kind;         /* enum bistouri_cfa_kind */
	__u8 rbp_kind;         /* enum bistouri_rbp_kind */
};

/*
 * An executable mapping whose file has a table: rows [first, first + count) of
 * unwind_rows, then a bucket index at `buckets`: entry b (its pc field) is the
 * row covering the start of bucket bucket_base + b (pcs >> bucket_shift), for b
 * in [0, bucket_count]. The shift is chosen per file for a few rows a bucket.
 */
struct bistouri_unwind_mapping {
	__u64 start;
	__u64 end;
	__u64 bias;            /* table pc = ip - bias */
	__u32 first;
	__u32 count;
	__u32 buckets;
	__u32 bucket_count;
	__u32 bucket_base;     /* first bucket of the table: its lowest pc >> bucket_shift */
	__u32 bucket_shift;     /* low 5 bits; | BISTOURI_MAPPING_FP_CALLERS */
};

/* In bucket_shift: the file's return addresses all take the frame-pointer rule (tables.py, ehframe.py). */
#define BISTOURI_MAPPING_FP_CALLERS (1U << 31)

/* A process's mappings with tables: entries [slot * BISTOURI_UNWIND_MAPPINGS, + count) of unwind_mappings. */
struct bistouri_unwind_proc {
	__u32 slot;
	__u32 count;
	__u32 flags;            /* BISTOURI_UNWIND_PROC_* */
};

/*
 * In flags: the process has no python_procs record (tables.py, told by the profiler), so its
 * samples skip the Python walk's lookup. Only ever "not Python": a process without this entry
 * (frame pointers only, tables not in yet) still has python_procs looked up.
 */
#define BISTOURI_UNWIND_PROC_NO_PYTHON 1U

/* Identity of a user stack: same process image (mm), same raw IPs (hash). */
struct bistouri_user_stack_key {
	__u32 pid;             /* tgid */
	__u32 reserved;
	__u64 mm;              /* address of the mm_struct: changes at exec */
	__u64 hash;            /* FNV-1a of the raw user IPs */
};

/*
 * Identity of an on-CPU sample for counting in the kernel: thread, kernel
 * stack, user stack. The first sample of a key in a drain interval is sent
 * whole; repeats only add to its count, which user space drains.
 */
struct bistouri_sample_key {
	__u32 tid;
	__u32 reserved;
	__u64 kernel_hash;     /* FNV-1a of the kernel IPs */
	struct bistouri_user_stack_key user;
};

/*
 * ---- CPython frames (issue 21, docs/python-frames.md): bpf/python.bpf.h's walk. ----
 * User space (bistouri/cpython/) describes a CPython process in one python_proc
 * record; at a sample of it, the sampled thread's frame chain goes into the stack
 * event as py_frames, innermost first.
 */
#ifndef BISTOURI_PY_MAX_DEPTH
#define BISTOURI_PY_MAX_DEPTH 64  /* Python frames per stack event */
#endif
#define BISTOURI_PY_FRAME_ENTRY 1ULL      /* bit 0 of py_frame.code: the oldest frame of one C eval activation */
#define BISTOURI_PY_NO_OFFSET 0xffffffffU /* py_frame.offset not known (before the first instruction) */

/* How a frame's instruction field reads (bistouri/cpython/layouts.py InstrKind). */
enum bistouri_py_instr_kind {
	BISTOURI_PY_INSTR_LASTI_BYTES = 0, /* int f_lasti, bytes (3.8, 3.9) */
	BISTOURI_PY_INSTR_LASTI_UNITS = 1, /* int f_lasti, 2-byte code units (3.10) */
	BISTOURI_PY_INSTR_POINTER = 2, /* pointer into the code object's bytecode (3.11+) */
};

/* How the walk finds where a C activation of the eval loop starts (layouts.py EntryKind). */
enum bistouri_py_entry_kind {
	BISTOURI_PY_ENTRY_EVERY = 0,    /* <= 3.10: every frame */
	BISTOURI_PY_ENTRY_IS_ENTRY = 1, /* 3.11: the byte at frame_entry is 1 */
	BISTOURI_PY_ENTRY_SHIM = 2,     /* 3.12+: a shim frame (byte at frame_entry == shim_owner) under each; not emitted */
};

/* Why a stack event's Python walk ended (its py_status). */
enum bistouri_py_status {
	BISTOURI_PY_STATUS_NOT_PYTHON = 0, /* no python_proc record for the process */
	BISTOURI_PY_STATUS_DONE = 1,       /* reached the outermost frame */
	BISTOURI_PY_STATUS_NO_THREAD = 2,  /* the thread has no thread state (not a Python thread, or not yet) */
	BISTOURI_PY_STATUS_READ_FAILED = 3,/* a frame could not be read (paged out, torn) */
	BISTOURI_PY_STATUS_DEPTH = 4,      /* BISTOURI_PY_MAX_DEPTH frames taken, older ones left out */
	BISTOURI_PY_STATUS_NO_ARCH = 5,    /* no walk on this architecture yet */
};

/* A CPython process, for the walk: offsets in bytes (bistouri/cpython/layouts.py). */
struct bistouri_python_proc {
	__u64 tstate_slot;     /* the thread's PyThreadState* is at thread pointer + tstate_slot */
	__u16 tstate_frame;    /* tstate -> innermost frame (or -> _PyCFrame when cframe_frame >= 0) */
	__s16 cframe_frame;    /* _PyCFrame -> current_frame (3.11, 3.12); -1: none */
	__u16 frame_previous;
	__u16 frame_code;
	__u16 frame_instr;
	__s16 frame_entry;     /* is_entry or owner byte; -1: none */
	__u16 frame_size;      /* bytes of a frame read at once: covers the fields above (<= 128) */
	__u16 code_adaptive;   /* co_code_adaptive (3.11+) */
	__u16 code_window;     /* the code object's checksum fields are read from code + code_window ... */
	__u16 code_window_size;/* ... for this many bytes (<= 128); their offsets in that window: */
	__u16 code_firstlineno;
	__u16 code_filename;
	__u16 code_name;
	__u16 code_linetable;
	__u8 instr_kind;       /* enum bistouri_py_instr_kind */
	__u8 entry_kind;       /* enum bistouri_py_entry_kind */
	__u8 shim_owner;
	__u8 reserved;
	__u16 version;         /* major << 8 | minor, for diagnostics */
	__u16 str_hash;        /* a str's cached hash (the name's goes into the checksum without a co_version) */
	__s16 tstate_datastack;/* tstate -> datastack_chunk, then datastack_top: the frames' stack (3.11+); -1: none */
	__s16 code_version;    /* co_version's offset in the code window (3.12+; into the checksum); -1: none */
	/*
	 * The process's count of code objects made, which CPython bumps at each new one (where
	 * co_version comes from): its address (3.12: _Py_next_func_version), or with counter_in_interp
	 * its offset in the thread's interpreter state (3.13: func_state.next_version); 0: none.
	 * While it stays the same no code object was made, so no address can hold a new one: the walk
	 * then takes a code object's checksum from earlier samples (python.bpf.h, py_code_seen).
	 */
	__u64 code_counter;
	__u32 owner;           /* this record's own number in the agent: cached checksums are its own */
	__u16 tstate_interp;   /* tstate -> its PyInterpreterState */
	__u8 counter_in_interp;
	__u8 reserved2;
};

/* One Python frame of a stack event. */
struct bistouri_py_frame {
	__u64 code;            /* PyCodeObject address | BISTOURI_PY_FRAME_ENTRY */
	__u32 offset;          /* instruction offset in code units from the first; BISTOURI_PY_NO_OFFSET */
	__u32 checksum;        /* of the code object's identity fields (layouts.py checksum); 0: unread */
};

/* A sampled stack, on-CPU or off-CPU. Sizes are in bytes, negative on error. */
struct bistouri_stack_event {
	__u32 kind;            /* enum bistouri_event_kind */
	__u32 pid;             /* tgid */
	__u32 tid;
	__u32 cpu;
	__u64 timestamp_ns;    /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u64 blocked_ns;      /* off-CPU: the mean time of the `waits` it stands for (times waits: their time); 0 on-CPU */
	__u32 waits;           /* off-CPU: waits this one stands for (1 + rate-limited since the last capture); 1 on-CPU */
	__u32 map_count;       /* VMAs of the process (mm->map_count): user space re-reads its maps when it changes */
	struct bistouri_user_stack_key user_key;
	__u64 kernel_hash;     /* FNV-1a of the kernel IPs: with tid and user_key, the sample key */
	__s32 kernel_stack_size;
	__s32 user_stack_size;
	__u8 user_by_table;    /* user frames unwound from an .eh_frame table */
	__u8 user_by_fp;       /* user frames unwound by the frame pointer */
	__u8 user_walk_end;    /* why the user walk ended: a BISTOURI_CNT_WALK_* counter, 0 if none */
	__u8 py_depth;         /* Python frames in py_frames */
	__u8 py_status;        /* enum bistouri_py_status */
	__u8 reserved[3];
	__u8 comm[BISTOURI_COMM_LEN];
	__u64 kernel_stack[BISTOURI_MAX_DEPTH];
	__u64 user_stack[BISTOURI_MAX_DEPTH]; /* raw IPs: user space maps them to files (bistouri/host/procmaps.py) */
	struct bistouri_py_frame py_frames[BISTOURI_PY_MAX_DEPTH]; /* innermost first; the record ends after
								    * the py_depth taken (emit_stack) */
};

/*
 * An on-CPU sample of a process that asked for them (BISTOURI_FILTER_RAW_STACK)
 * whose user walk was cut short (no table for a PC yet: `record`'s first
 * seconds on a large binary): the walk's registers and the top of the user
 * stack, which user space walks with the same rows once they are in
 * (bistouri/unwind/rawwalk.py), as perf does with its copies. Sent to the
 * raw_stacks ring, up to the stack_size bytes copied.
 */
#ifndef BISTOURI_RAW_STACK_BYTES
/* Twice perf's --call-graph dwarf default: 8 KiB copies of cc1plus's parser stacks end short. */
#define BISTOURI_RAW_STACK_BYTES 16384
#endif

struct bistouri_raw_stack {
	__u64 ip;              /* the user registers the walk started from */
	__u64 sp;
	__u64 bp;
	__u64 lr;              /* aarch64's x30 (a leaf's return address may be there only); 0 on x86-64 */
	__u32 stack_size;      /* bytes of stack copied from sp (the copy stops at a page not present) */
	__u32 reserved;
	struct bistouri_stack_event event; /* the sample as the BPF walk left it */
	__u8 stack[BISTOURI_RAW_STACK_BYTES];
};

/* A process whose new comm matched a rule of the LPM trie at exec. */
struct bistouri_exec_event {
	__u32 rule_id;
	__u32 pid;             /* tgid */
	__u64 cgroup_id;       /* cgroup2 inode of the process */
	__u8 comm[BISTOURI_COMM_LEN];
};

/* Why a sample or event was lost, with the process it concerned. */
struct bistouri_error_event {
	__u32 kind;            /* enum bistouri_counter */
	__u32 pid;
	__s64 code;            /* helper return value, 0 if none */
	__u64 timestamp_ns;
};

/* Key of the comm LPM trie: prefixlen in bits over comm. */
struct bistouri_comm_key {
	__u32 prefixlen;
	__u8 comm[BISTOURI_COMM_LEN];
};

/* Tunables written into .rodata before load. */
struct bistouri_config {
	__u64 offcpu_min_ns;      /* waits shorter than this are not reported */
	__u64 offcpu_interval_ns; /* per-process minimum gap between off-CPU captures */
	__u64 runqueue_interval_ns; /* per-process minimum gap between run-queue wait stacks */
	__u64 wakeup_bytes;       /* force a consumer wakeup past this much queued data */
	__u32 tp_btf_skip;        /* kernel frames to skip in tp_btf programs */
	__u32 reserved;           /* 0 (was `aggregate`, a switch only a test used) */
};

/*
 * ---- Episode report (issue 12): the watched threads' time by state. ----
 * Kept apart from the sampling structs above. A tgid whose pid_filter value has
 * BISTOURI_EPISODE_FILTER_ON gets its threads' time accounted in `thread_times`
 * (on-CPU, run-queue, blocked D/S, reclaim) and stacks of its interruptible
 * sleeps and reclaim stalls sent as stack events of the kinds below.
 */
enum bistouri_episode_filter {
	BISTOURI_EPISODE_FILTER_ON = 4, /* a pid_filter bit, beside enum bistouri_filter_flags */
};

enum bistouri_episode_kind {
	BISTOURI_EVENT_SLEEP = 16,    /* interruptible (S) wait, timed at wakeup/switch-in */
	BISTOURI_EVENT_RECLAIM = 17,  /* direct reclaim or compaction, timed begin -> end */
	BISTOURI_EVENT_RUNQUEUE = 18, /* waiting for a CPU, timed to switch-in: blocked_ns is the mean
				       * delay of the `waits` it stands for (see bistouri.bpf.c) */
};

/* What a watched thread is doing since thread_times.since_ns. */
enum bistouri_thread_state {
	BISTOURI_STATE_UNKNOWN = 0,  /* not seen switching yet */
	BISTOURI_STATE_RUNNING = 1,
	BISTOURI_STATE_RUNNABLE = 2, /* woken or preempted, waiting for a CPU */
	BISTOURI_STATE_BLOCKED_D = 3,
	BISTOURI_STATE_BLOCKED_S = 4,
};

/* Counters of the episode hooks; indexes of the per-CPU `episode_counters` map. */
enum bistouri_episode_counter {
	BISTOURI_EPC_SWITCHES = 0,      /* switches of watched threads accounted */
	BISTOURI_EPC_WAKEUPS = 1,       /* wakeups of watched threads accounted */
	BISTOURI_EPC_THREADS_FULL = 2,  /* thread_times full: a new thread not accounted */
	BISTOURI_EPC_STACKS_LIMITED = 3,/* sleep/reclaim stack skipped by the per-thread rate limit,
					 * run-queue stack by the per-process one */
	BISTOURI_EPC_RECLAIMS = 4,      /* reclaim/compaction stalls accounted */
	BISTOURI_EPC_RUNQUEUE_STACKS = 5, /* run-queue stacks sent */
	BISTOURI_EPC_STACKS_REUSED = 6, /* sleep stacks copied from the recorder's entry, not walked
					 * (episode.bpf.h: take_stack) */
	BISTOURI_EPC_MAX = 7,
};

/* Cumulative times of one watched thread (user space diffs two reads). */
struct bistouri_thread_times {
	__u32 pid;             /* tgid */
	__u32 tid;
	__u64 on_cpu_ns;
	__u64 runqueue_ns;
	__u64 blocked_d_ns;
	__u64 blocked_s_ns;
	__u64 reclaim_ns;
	__u64 runqueue_waits;
	__u64 d_waits;
	__u64 s_waits;
	__u64 reclaims;
	__u64 since_ns;        /* when `state` began (bpf_ktime_get_ns) */
	__u64 reclaim_start_ns; /* 0: not in reclaim */
	__u64 stack_ns;        /* last sleep stack taken (rate limit) */
	__u32 state;           /* enum bistouri_thread_state */
	__u32 skipped;         /* sleeps since the last sleep stack: the next one stands for them */
	__u8 comm[BISTOURI_COMM_LEN];
	__u64 runqueue_unsent_ns; /* run-queue delay not yet carried by a run-queue stack */
	__u32 runqueue_unsent;    /* run-queue waits not yet carried by a run-queue stack */
	__u32 reserved;
	__u64 stack_at;           /* where its last walked sleep stack began (blocked_at); 0: none */
	__u64 stack_kernel_hash;  /* that walk's kernel_hash */
	__u64 stack_user_hash;    /* and user_key.hash */
};

/*
 * ---- The flight recorder's waits, counted in the kernel (issue 22; recorder.bpf.h). ----
 * One recorder_waits entry per thread, wait kind and stack of a process only the
 * recorder watches, with its waits in each of the last BISTOURI_RECORDER_SLOTS seconds.
 */
#define BISTOURI_RECORDER_SLOTS 64

struct bistouri_recorder_key {
	__u32 tid;
	__u32 kind;                          /* the event kind of the waits (OFF_CPU, SLEEP, ...) */
	__u64 kernel_hash;
	struct bistouri_user_stack_key user_key; /* its pid: the process */
};

/* The waits of one second: slot second % BISTOURI_RECORDER_SLOTS, stale once `second` is older. */
struct bistouri_recorder_slot {
	__u32 second;          /* bpf_ktime_get_ns() / 1 s when they ended */
	__u32 waits;
	__u64 blocked_ns;      /* their time, all of it */
};

struct bistouri_recorded_wait {
	struct bistouri_recorder_slot slots[BISTOURI_RECORDER_SLOTS];
	/* The first event of the entry up to its Python frames (waits with Python frames are sent). */
	__u8 event[__builtin_offsetof(struct bistouri_stack_event, py_frames)];
};

/* Counters of the recorder's waits; indexes of the per-CPU `recorder_counters` map. */
enum bistouri_recorder_counter {
	BISTOURI_RC_KEPT = 0,     /* waits events counted into recorder_waits instead of sent */
	BISTOURI_RC_ENTRIES = 1,  /* entries created (minus those present: evicted, least recently used) */
	BISTOURI_RC_REFUSED = 2,  /* an event the map could not take: lost */
	BISTOURI_RC_MAX = 3,
};

#endif /* BISTOURI_H */
