/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * CPython frames at sample time (issue 21; design in docs/python-frames.md).
 *
 * User space (bistouri/cpython/discover.py) describes a CPython process in a
 * python_procs record: where the sampled thread's PyThreadState is from the
 * thread pointer (its pthread key slot, right also while the thread waits without
 * the GIL) and the version's offsets. walk_python() then follows the thread's
 * frame chain, innermost first, and puts one bistouri_py_frame per Python frame
 * into the event: the code object's address, the instruction offset and a
 * checksum of the code object's identity fields (user space names the code later
 * and must not name a freed and reused address with another function's name).
 * Strings and line tables are never read here: unbounded, and user space has time.
 *
 * Every read is bpf_probe_read_user (a fault is a failed read, never a crash),
 * whose cost is mostly the call's, not the bytes': the walk is counted in reads.
 * A frame or a code object is read in one call into per-CPU scratch, and its
 * fields taken at masked offsets. Per frame, at most: the frame, except where
 * it lies in the thread's frame stack (3.11+: one read takes its newest
 * PY_STACK_WINDOW bytes, most frames of a stack); the code object's window,
 * except when this walk read that code object already (recursion) or, 3.12+,
 * an earlier sample did and the process has made no code object since
 * (py_code_seen); the name's hash, except where the code object has a
 * co_version (3.12+). Per walk, on 3.11+: the thread state's fields in one
 * read, the stack window in another, 3.12+ the count of code objects made. The chain is
 * walked by bpf_loop (5.17+; before, walk_python_bounded: PY_BOUNDED_STEPS
 * unrolled), a step a global function (py_frame_step). Its maps (python_procs, py_scratch) are in maps.bpf.h. Included
 * after maps.bpf.h and before stack.bpf.h.
 */
#ifndef BISTOURI_PYTHON_BPF_H
#define BISTOURI_PYTHON_BPF_H

#define PY_OFF_MASK 127   /* field offsets masked into the scratch: + 8 stays inside it */
/* Frames looked at per walk: the emitted ones, plus the 3.12+ shims (one per C activation), which are not. */
#define PY_MAX_STEPS (BISTOURI_PY_MAX_DEPTH + BISTOURI_PY_MAX_DEPTH / 2)
#ifndef PY_BOUNDED_STEPS
#define PY_BOUNDED_STEPS 32
#endif
_Static_assert((BISTOURI_PY_MAX_DEPTH & (BISTOURI_PY_MAX_DEPTH - 1)) == 0, "frame indexes are masked");

static __always_inline __u64 py_u64(const __u8 *buf, __u32 off)
{
	return *(const __u64 *)(buf + (off & PY_OFF_MASK));
}

static __always_inline __u32 py_u32(const __u8 *buf, __u32 off)
{
	return *(const __u32 *)(buf + (off & PY_OFF_MASK));
}

static __always_inline __u64 py_rotl(__u64 v, int n)
{
	return (v << n) | (v >> (64 - n));
}

/* bistouri/cpython/layouts.py checksum(): the same formula, the same 32 bits. */
static __always_inline __u32 py_checksum(__u64 filename, __u64 name, __u64 table, __u32 firstlineno,
					 __u64 name_hash)
{
	__u64 x = filename ^ py_rotl(name, 21) ^ py_rotl(table, 42) ^ firstlineno ^ py_rotl(name_hash, 11);
	__u32 c = (x * 0x9E3779B97F4A7C15ULL) >> 32;

	return c ? c : 1;
}

/* The instruction offset of a frame, in code units, from its instruction field. */
static __always_inline __u32 py_offset(const struct bistouri_python_proc *pp, const __u8 *frame, __u64 code)
{
	__u64 first, at;
	__s32 lasti;

	if (pp->instr_kind == BISTOURI_PY_INSTR_POINTER) {
		at = py_u64(frame, pp->frame_instr);
		first = code + pp->code_adaptive;
		/* A frame that has not run its first instruction points just before it. */
		if (at < first || at - first >= (1ULL << 32))
			return BISTOURI_PY_NO_OFFSET;
		return (at - first) / 2;
	}
	lasti = (__s32)py_u32(frame, pp->frame_instr);
	if (lasti < 0)
		return BISTOURI_PY_NO_OFFSET;
	return pp->instr_kind == BISTOURI_PY_INSTR_LASTI_BYTES ? (__u32)lasti / 2 : (__u32)lasti;
}

/* The checksum of the code object at `code`; 0 when it cannot be read. */
static __always_inline __u32 py_code_checksum(const struct bistouri_python_proc *pp, __u8 *buf, __u64 code)
{
	__u32 size = pp->code_window_size;
	__u64 name, ident = 0;

	if (size == 0 || size > PY_READ_MAX)
		return 0;
	if (bpf_probe_read_user(buf, size, (const void *)(code + pp->code_window)))
		return 0;
	name = py_u64(buf, pp->code_name);
	/* co_version is unique to the code object; 0 where there is none (or the counter ran out). */
	if (pp->code_version >= 0)
		ident = py_u32(buf, pp->code_version);
	if (!ident && bpf_probe_read_user(&ident, sizeof(ident), (const void *)(name + pp->str_hash)))
		return 0;
	return py_checksum(py_u64(buf, pp->code_filename), name, py_u64(buf, pp->code_linetable),
			   py_u32(buf, pp->code_firstlineno), ident);
}

/* Where a walk is in the chain: what its steps read and write. No pointer in it (see struct py_walk). */
struct py_chain {
	__u64 frame;           /* the next frame to look at; 0: the chain ended */
	__u64 lo, hi;          /* s->stack holds the user memory [lo, hi) of the frame stack; hi 0: none */
	__u64 hash;            /* the user stack's hash, with the Python frames mixed in */
	__u32 n;               /* frames emitted */
	__u32 size;            /* bytes of a frame read */
};

/*
 * The walk's state, shared by walk_python and its bpf_loop steps. The pointers
 * stay out of the chain: py_frame_step() is a global function, and the verifier
 * makes whatever its pointer arguments point to unknown numbers once it returns.
 */
struct py_walk {
	struct bistouri_stack_event *ev;
	const struct bistouri_python_proc *pp;
	struct py_scratch *s;
	struct py_chain c;
	/* The count of code objects made is in s (py_scratch.counter): on this stack, 6.1's verifier
	 * found handle_perf -> walk_python -> py_step 544 bytes deep, past its 512. */
};

/* Whether a kept checksum is this code object's: same address, same count read at the same place, same record. */
static __always_inline bool py_code_kept(const struct bistouri_python_proc *pp, const struct py_scratch *s,
					 const struct py_code_entry *e, __u64 code)
{
	return e->code == code && e->counter == s->counter && e->counter_at == s->counter_at && e->owner == pp->owner;
}

/*
 * The checksum of a frame's code object: read once per code object and walk
 * (the frames of a walk hold their code objects, so an address seen earlier in
 * it is the same object), and from one sample to the next while the process's
 * count of code objects made (s->counter) has not moved. That holds without a
 * read: the frames of the sampled thread hold their code objects through the
 * sample, so the object at an address now is the one read then, or one made
 * since, and making it would have bumped the count (CPython's init_code, for
 * every code object; the count of the thread's own interpreter on 3.13, whose
 * threads run only its code objects). A count that ran out stays 0: never cached.
 * Kept two ways per set, the newer first: 30 code objects in a direct-mapped
 * table of 256 collided ~2 pairs a walk, each pair evicting the other (4 reads).
 */
static __always_inline __u32 py_code_seen(const struct bistouri_python_proc *pp, struct py_scratch *s, __u64 code)
{
	__u32 slot = ((code >> 4) ^ (code >> 10)) & (PY_SEEN - 1);
	__u32 set = ((code >> 4) ^ (code >> 12)) & (PY_CODE_CACHE - 2), sum;
	struct py_code_entry *e = &s->code_cache[set], *older = &s->code_cache[set + 1];

	if (s->seen_code[slot] == code)
		return s->seen_sum[slot];
	if (s->counter && py_code_kept(pp, s, e, code)) {
		sum = e->sum;
	} else if (s->counter && py_code_kept(pp, s, older, code)) {
		sum = older->sum;
	} else {
		sum = py_code_checksum(pp, s->code, code);
		if (s->counter && sum) {
			*older = *e;
			e->code = code;
			e->counter_at = s->counter_at;
			e->owner = pp->owner;
			e->counter = s->counter;
			e->sum = sum;
		}
	}
	s->seen_code[slot] = code;
	s->seen_sum[slot] = sum;
	return sum;
}

/*
 * One frame of the chain. Returns 1 to stop. `fast`: frames from the stack
 * window and checksums once per walk; without, one read a frame and one a
 * checksum, for the bounded walk: unrolled, those branches took its verifier 5×
 * the states (handle_perf_bounded 50 k -> 249 k instructions, the object's
 * load 1.3 -> 7.3 s).
 */
static __always_inline long py_step_how(struct py_chain *w, struct bistouri_stack_event *ev,
				       const struct bistouri_python_proc *pp, struct py_scratch *s, bool fast)
{
	__u32 n = w->n, at, size;
	const __u8 *f;         /* the frame's bytes */
	__u64 code;
	bool entry;
	__u8 b;

	if (!w->frame) {
		ev->py_status = BISTOURI_PY_STATUS_DONE;
		return 1;
	}
	if (n >= BISTOURI_PY_MAX_DEPTH)
		return 1; /* py_status stays DEPTH */
	size = w->size;
	if (size == 0 || size > PY_READ_MAX) {
		ev->py_status = BISTOURI_PY_STATUS_READ_FAILED;
		return 1;
	}
	if (fast && w->frame >= w->lo && w->frame < w->hi && w->hi - w->frame >= size) {
		/* In the stack window: no read (frame - lo < PY_STACK_WINDOW, the mask for the verifier). */
		f = s->stack + ((w->frame - w->lo) & (PY_STACK_WINDOW - 1));
	} else {
		/* Older than the window, in another chunk, a generator's or a C activation's shim. */
		if (bpf_probe_read_user(s->frame, size, (const void *)w->frame)) {
			ev->py_status = BISTOURI_PY_STATUS_READ_FAILED;
			return 1;
		}
		f = s->frame;
	}
	entry = pp->entry_kind == BISTOURI_PY_ENTRY_EVERY;
	if (pp->frame_entry >= 0) {
		b = f[pp->frame_entry & PY_OFF_MASK];
		if (pp->entry_kind == BISTOURI_PY_ENTRY_SHIM && b == pp->shim_owner) {
			/* The shim under a C activation's frames: its newer neighbour is their oldest. */
			if (n > 0)
				ev->py_frames[(n - 1) & (BISTOURI_PY_MAX_DEPTH - 1)].code |= BISTOURI_PY_FRAME_ENTRY;
			w->frame = py_u64(f, pp->frame_previous);
			return 0;
		}
		entry = pp->entry_kind == BISTOURI_PY_ENTRY_IS_ENTRY && b == 1;
	}
	code = py_u64(f, pp->frame_code);
	at = n & (BISTOURI_PY_MAX_DEPTH - 1);
	ev->py_frames[at].code = code | (entry ? BISTOURI_PY_FRAME_ENTRY : 0);
	ev->py_frames[at].offset = py_offset(pp, f, code);
	ev->py_frames[at].checksum = fast ? py_code_seen(pp, s, code) : py_code_checksum(pp, s->code, code);
	/* The checksum too: a function made at a freed one's address, sampled at the same offset, is not a
	 * repeat of the old one's sample (which would count it under the old name). */
	w->hash = (w->hash ^ code) * 0x100000001b3ULL;
	w->hash = (w->hash ^ ((__u64)ev->py_frames[at].checksum << 32 | ev->py_frames[at].offset)) * 0x100000001b3ULL;
	w->n = n + 1;
	w->frame = py_u64(f, pp->frame_previous);
	return 0;
}

/*
 * The bpf_loop walk's step, global: verified once. As the callback itself, 6.7+
 * verifiers (which walk a callback again until its state repeats) went through
 * its branches 9 times in handle_perf, 7.9 k of its instructions (6.18).
 */
__noinline int py_frame_step(struct py_chain *c, struct bistouri_stack_event *ev, const struct bistouri_python_proc *pp,
			     struct py_scratch *s)
{
	if (!c || !ev || !pp || !s)
		return 1;
	return py_step_how(c, ev, pp, s, true);
}

/* A bpf_loop step. */
static long py_step(__u32 i, void *arg)
{
	struct py_walk *w = arg;

	/* A global function's result is any int to the verifier; bpf_loop takes 0 or 1. */
	return py_frame_step(&w->c, w->ev, w->pp, w->s) ? 1 : 0;
}

/* The bounded walk's step: one subprogram called PY_BOUNDED_STEPS times, not as many copies of it. */
static __noinline long py_step_bounded(struct py_walk *w)
{
	return py_step_how(&w->c, w->ev, w->pp, w->s, false);
}

/*
 * The thread state's frame field (tstate_frame), its data stack's chunk and top
 * (3.11+) and, where the count of code objects is its interpreter's, its
 * interpreter: one read into s->stack (before py_stack_window fills it). They
 * lie a few hundred bytes apart, and a read costs about the same for 8 bytes as
 * for 256. Returns -1 when it cannot read them; ends and *interp stay 0 when
 * they are too far apart (the caller then has the frame field alone, no window).
 */
static __always_inline long py_tstate_fields(struct py_walk *w, __u64 tstate, __u64 *frame, __u64 ends[2],
					     __u64 *interp)
{
	const struct bistouri_python_proc *pp = w->pp;
	__u32 at_frame = pp->tstate_frame, at_stack = (__u32)pp->tstate_datastack, at_interp = pp->tstate_interp;
	const __u8 *buf = w->s->stack;
	__u64 lo, hi, size;

	lo = at_frame < at_stack ? at_frame : at_stack;
	hi = at_frame + 8 > at_stack + 16 ? at_frame + 8 : at_stack + 16;
	if (pp->counter_in_interp) {
		lo = at_interp < lo ? at_interp : lo;
		hi = at_interp + 8 > hi ? at_interp + 8 : hi;
	}
	size = hi - lo;
	if (hi <= lo || size > PY_STACK_WINDOW)
		return bpf_probe_read_user(frame, sizeof(*frame), (const void *)(tstate + at_frame)) ? -1 : 0;
	if (bpf_probe_read_user(w->s->stack, size, (const void *)(tstate + lo)))
		return -1;
	/* Masked for the verifier: s->stack has PY_READ_MAX + 8 bytes past the window. */
	*frame = *(const __u64 *)(buf + ((at_frame - lo) & (PY_STACK_WINDOW - 1)));
	ends[0] = *(const __u64 *)(buf + ((at_stack - lo) & (PY_STACK_WINDOW - 1)));
	ends[1] = *(const __u64 *)(buf + ((at_stack + 8 - lo) & (PY_STACK_WINDOW - 1)));
	if (pp->counter_in_interp)
		*interp = *(const __u64 *)(buf + ((at_interp - lo) & (PY_STACK_WINDOW - 1)));
	return 0;
}

/* The process's count of code objects made, into w (0 where there is none or it cannot be read). */
static __always_inline void py_code_counter(struct py_walk *w, __u64 interp)
{
	__u64 at = w->pp->code_counter;
	__u32 counter = 0;

	if (!at || (w->pp->counter_in_interp && !interp))
		return;
	if (w->pp->counter_in_interp)
		at += interp;
	if (bpf_probe_read_user(&counter, sizeof(counter), (const void *)at))
		return;
	w->s->counter = counter;
	w->s->counter_at = at;
}

/*
 * The newest PY_STACK_WINDOW bytes of the thread's frame stack (3.11+: the
 * frames of its C activations, innermost at the top) into s->stack, in one
 * read: up to the top (ends[1]), down to the chunk's start (ends[0]) at most
 * (memory below it may not be mapped, and a read of a page that is not fails
 * whole). Whatever the bounds, the window is a copy of the process's memory at
 * the sample: a frame inside it reads as it would alone (wrong bounds would
 * only cost reads).
 */
static __always_inline void py_stack_window(struct py_walk *w, const __u64 ends[2])
{
	__u64 lo, size;

	if (!ends[0] || ends[1] <= ends[0])
		return;
	lo = ends[1] - ends[0] > PY_STACK_WINDOW ? ends[1] - PY_STACK_WINDOW : ends[0];
	size = ends[1] - lo;
	if (size == 0 || size > PY_STACK_WINDOW || bpf_probe_read_user(w->s->stack, size, (const void *)lo))
		return;
	w->c.lo = lo;
	w->c.hi = ends[1];
}

/*
 * The current thread's Python frames into ev->py_frames (ev->py_depth of them,
 * ev->py_status why the walk ended), mixed into the user stack's hash: a
 * repeat of a sample must have the same Python frames too.
 *
 * A global function: the verifier checks it once, apart from its callers (each
 * of the many paths out of the native walk would otherwise walk it again:
 * inlined, it more than doubled the object's load time).
 */
static __always_inline int walk_python_how(struct bistouri_stack_event *ev, __u32 slot, bool bounded)
{
	/* Read by CO-RE either way: the BTF pointer (5.11) only saves probe reads. */
	struct task_struct *task = bounded ? (struct task_struct *)bpf_get_current_task() : bpf_get_current_task_btf();
	struct py_walk w = { .ev = ev };
	__u64 tstate = 0, frame = 0, fsbase;
	__u32 key = slot, pid;

	if (!ev)
		return 0;
	ev->py_depth = 0;
	ev->py_status = BISTOURI_PY_STATUS_NOT_PYTHON;
	/* The key from the stack: before 6.x a helper takes no key in an argument's memory (a global
	 * function's pointer is "mem", which 6.1's verifier refuses for map keys). */
	pid = ev->pid;
	w.pp = bpf_map_lookup_elem(&python_procs, &pid);
	if (!w.pp)
		return 0;
	/* Its own scratch: a perf sample may interrupt a tracepoint's walk on this CPU. */
	w.s = bpf_map_lookup_elem(&py_scratch, &key);
	if (!w.s)
		return 0;
	/* Per walk, kept in the scratch (not this stack: see struct py_walk). */
	w.s->ends[0] = w.s->ends[1] = w.s->interp = w.s->counter_at = 0;
	w.s->counter = 0;
#if defined(__TARGET_ARCH_x86)
	fsbase = BPF_CORE_READ(task, thread.fsbase);
#else
	(void)task; /* the thread pointer of other architectures is not read yet */
	ev->py_status = BISTOURI_PY_STATUS_NO_ARCH;
	return 0;
#endif
	ev->py_status = BISTOURI_PY_STATUS_NO_THREAD;
	if (!fsbase || bpf_probe_read_user(&tstate, sizeof(tstate), (const void *)(fsbase + w.pp->tstate_slot)) ||
	    !tstate)
		return 0;
	if (!bounded && w.pp->tstate_datastack >= 0) {
		/* 3.11+: the frame field and the frame stack's bounds in one read. */
		if (py_tstate_fields(&w, tstate, &frame, w.s->ends, &w.s->interp))
			return 0;
		py_code_counter(&w, w.s->interp);
	} else if (bpf_probe_read_user(&frame, sizeof(frame), (const void *)(tstate + w.pp->tstate_frame))) {
		return 0;
	}
	if (w.pp->cframe_frame >= 0 && frame &&
	    bpf_probe_read_user(&frame, sizeof(frame), (const void *)(frame + w.pp->cframe_frame)))
		return 0;
	w.c.frame = frame;
	w.c.size = w.pp->frame_size;
	if (!bounded) {
		for (int i = 0; i < PY_SEEN; i++)
			w.s->seen_code[i] = 0;
		if (frame)
			py_stack_window(&w, w.s->ends);
	}
	w.c.hash = ev->user_key.hash;
	ev->py_status = BISTOURI_PY_STATUS_DEPTH;
	if (bounded) {
		/* No bpf_loop (< 5.17): the verifier walks each iteration, so fewer of them. */
		for (int i = 0; i < PY_BOUNDED_STEPS; i++)
			if (py_step_bounded(&w))
				break;
	} else {
		bpf_loop(PY_MAX_STEPS, py_step, &w, 0);
	}
	ev->py_depth = w.c.n;
	ev->user_key.hash = w.c.hash;
	return 0;
}

__noinline int walk_python(struct bistouri_stack_event *ev, __u32 slot)
{
	return walk_python_how(ev, slot, false);
}

/* walk_python without bpf_loop (the *_bounded programs): PY_BOUNDED_STEPS frames at most. */
__noinline int walk_python_bounded(struct bistouri_stack_event *ev, __u32 slot)
{
	return walk_python_how(ev, slot, true);
}

#endif /* BISTOURI_PYTHON_BPF_H */
