/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The user-stack walk from .eh_frame rules (walk_user), for Debian's binaries
 * and libraries built without frame pointers: per frame, find the rule of its
 * PC in the tables user space loaded (bistouri/unwind/tables.py: unwind_procs ->
 * unwind_mappings -> unwind_rows), then take one step (unwind_step.h, the
 * same code the unprivileged tests run in user space). The frame pointer
 * stands in where no table covers the PC (JIT code, a file not loaded yet).
 *
 * Most of what is here is shaped by the verifier and by measured costs: the
 * frames are walked by bpf_loop, whose callback hands the step to a global
 * function (frame_step); the step, the rule search and the stack read are
 * global functions verified once, the searches are unrolled, a rule cache and
 * a copy of the stack save helper calls. Each comment below says which.
 */
#ifndef BISTOURI_UNWIND_BPF_H
#define BISTOURI_UNWIND_BPF_H

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
	struct unwind_regs regs;
	struct stack_window win;           /* of the copy of the user stack (struct walk_loop's) */
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
#if defined(__TARGET_ARCH_arm64)
	bool sp_floor;                     /* regs.sp is a lower bound (unwind_step.h) */
#endif
};

/*
 * The walk and its two pointers, which stay out of struct walk: frame_step() is
 * a global function, and the verifier makes whatever its pointer arguments
 * point to unknown numbers once it returns (it may have written them).
 */
struct walk_loop {
	struct bistouri_stack_event *ev;
	struct stack_copy *copy;
	struct walk w;
};

/*
 * Binary searches below are unrolled steps (array lookups are inlined by the
 * verifier: a step is a few instructions), not bpf_loop callbacks: a helper call
 * per step was most of the walk's time. Only a row range wider than
 * UNROLLED_ROWS (a dense bucket) still goes through bpf_loop first.
 */
#define UNROLLED_ROWS 16

/* Frames of the bounded walk (*_bounded programs: kernels without bpf_loop). */
#ifndef BOUNDED_DEPTH
#define BOUNDED_DEPTH 32
#endif

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
static __always_inline struct bistouri_unwind_row *find_row(struct bistouri_unwind_mapping *m, __u32 pc,
							     bool bounded)
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
	if (s.lo + UNROLLED_ROWS < s.hi) {
		if (bounded) { /* no bpf_loop (< 5.17): the same steps as a bounded loop */
			for (int i = 0; i < 24; i++)
				if (row_search_step(i, &s))
					break;
		} else {
			bpf_loop(24, row_search_step, &s, 0); /* tables hold < 2^24 rows */
		}
	}
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
	__u32 slot;          /* in: the process's slot of unwind_mappings */
	__u32 count;         /* in: its mappings */
	__u32 last_mapping;  /* in/out: index of the previous frame's mapping, ~0 if none */
	__u32 exact;         /* in: ip is where the thread was, not a return address */
	__u32 cache_base;    /* in: this context's first entry of rule_cache */
	__u32 cached;        /* out: the rule came from rule_cache */
	struct unwind_rule rule; /* out: cfa_kind BISTOURI_CFA_NONE if no table covers ip */
	__u32 fp_ok;         /* in: ip is a return address and RBP is not 0 (fp_callers) */
	__u32 by_fp_file;    /* out: the rule is the frame pointer's of a marked file, not searched */
};

/*
 * Whether ip's rule is the frame pointer's without a search: a return address (fp_ok) in a file
 * whose every row a return address can be in is the frame-pointer rule or one the walk takes by
 * frame pointer anyway (tables.py marks the mapping: ehframe.py callers_by_frame_pointer says
 * why). A row search is ~10 reads of a large map, cache-cold on a busy host: most of a new
 * stack's time. x86-64 only (aarch64's files stay unmarked). Not cached (rule_cache): it holds
 * for this RBP only (0: searched, the outermost frame's END row).
 */
static __always_inline int fp_callers(struct frame_rule *r, struct bistouri_unwind_mapping *m)
{
#if defined(__TARGET_ARCH_arm64)
	return 0;
#else
	if (!r->fp_ok || !(m->bucket_shift & BISTOURI_MAPPING_FP_CALLERS))
		return 0;
	r->rule.bias = m->bias;
	r->rule.cfa_kind = BISTOURI_CFA_RBP;
	r->rule.cfa_off = FP_CFA_OFF;
	r->rule.rbp_kind = BISTOURI_RBP_AT_CFA;
	r->rule.rbp_off = FP_SAVED_RBP_OFF;
	r->by_fp_file = 1;
	return 1;
#endif
}

/* The rule from the tables: global, verified on its own (its searches' branches would multiply frame_rule's states). */
static __always_inline int find_rule_how(struct frame_rule *r, bool bounded)
{
	struct bistouri_unwind_proc proc;
	struct bistouri_unwind_mapping *m = NULL;
	struct bistouri_unwind_row *row;
	__u32 last;
	__u64 pc;

	if (!r)
		return 0;
	r->rule.cfa_kind = BISTOURI_CFA_NONE;
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
	if (fp_callers(r, m))
		return 1;
	/* A return address is past its call: look up the call itself. */
	pc = r->ip - m->bias - (r->exact ? 0 : 1);
	r->rule.bias = m->bias;
	row = find_row(m, (__u32)pc, bounded);
	if (!row)
		return 0;
	/* The row's narrow fields widened once, here: the rest of the walk passes the rule whole. */
	r->rule.cfa_kind = row->cfa_kind;
	r->rule.cfa_off = row->cfa_off;
	r->rule.rbp_kind = row->rbp_kind;
	r->rule.rbp_off = row->rbp_off;
	return 1;
}

__noinline int find_rule(struct frame_rule *r)
{
	return find_rule_how(r, false);
}

/* find_rule without bpf_loop, for the *_bounded programs. */
__noinline int find_rule_bounded(struct frame_rule *r)
{
	return find_rule_how(r, true);
}

static __always_inline int frame_rule_how(struct frame_rule *r, bool bounded)
{
	struct rule_cache_entry *e;
	__u32 at;
	int found;

	if (!r)
		return 0;
	r->cached = 0;
	r->by_fp_file = 0;
#if !defined(__TARGET_ARCH_arm64)
	/* The previous frame's file (callers mostly are in their callee's): no cache probe either. */
	if (r->fp_ok && r->last_mapping != ~0U) {
		__u32 last = r->last_mapping;
		struct bistouri_unwind_mapping *m = bpf_map_lookup_elem(&unwind_mappings, &last);

		if (m && r->ip >= m->start && r->ip < m->end && fp_callers(r, m))
			return 1;
	}
#endif
	at = r->cache_base + ((__u32)(r->ip ^ (r->ip >> 8) ^ (r->ip >> 16)) & (RULE_CACHE_ENTRIES - 1));
	e = bpf_map_lookup_elem(&rule_cache, &at);
	if (e && e->ip == r->ip && e->generation == r->generation && e->slot == r->slot && e->exact == r->exact) {
		r->rule = e->rule;
		r->last_mapping = e->mapping;
		r->cached = 1;
		return e->rule.cfa_kind != BISTOURI_CFA_NONE;
	}
	found = bounded ? find_rule_bounded(r) : find_rule(r);
	if (e && !r->by_fp_file) {
		/* Misses too: a PC no table covers (JIT code) is as frequent as any. */
		e->ip = r->ip;
		e->generation = r->generation;
		e->slot = r->slot;
		e->exact = r->exact;
		e->mapping = r->last_mapping;
		e->rule = r->rule; /* cfa_kind BISTOURI_CFA_NONE if not found (find_rule sets it first) */
	}
	return found;
}

__noinline int frame_rule(struct frame_rule *r)
{
	return frame_rule_how(r, false);
}

__noinline int frame_rule_bounded(struct frame_rule *r)
{
	return frame_rule_how(r, true);
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

/* One word of the user stack (unwind_step.h's reader): from the copy when it holds it, else read on its own. */
static __always_inline long unwind_read(struct walk *w, struct stack_copy *copy, __u64 addr, __u64 *out)
{
	w->win.addr = addr;
	if (stack_word(copy, &w->win))
		return -1;
	*out = w->win.word;
	return 0;
}

#include "unwind_step.h"

/* Record the frame's ip; 1 ends the walk (too deep). */
static __always_inline long record_frame(struct walk *w, struct bistouri_stack_event *ev)
{
	if (w->n >= BISTOURI_MAX_DEPTH) {
		w->stop = BISTOURI_CNT_WALK_DEPTH;
		return 1;
	}
	ev->user_stack[w->n & 127] = w->regs.ip;
	w->n++;
	return 0;
}

/* The frame's rule lookup (frame_rule) asked from the walk, and its answer kept for the next frame. */
static __always_inline void rule_query(const struct walk *w, struct frame_rule *r)
{
	r->ip = w->regs.ip;
	r->slot = w->proc_slot;
	r->count = w->proc_count;
	r->last_mapping = w->last_mapping;
	r->exact = w->exact;
	r->generation = w->generation;
	r->cache_base = w->cache_base;
	r->fp_ok = !w->exact && w->regs.bp;
}

static __always_inline void rule_answer(struct walk *w, const struct frame_rule *r)
{
	w->last_mapping = r->last_mapping;
	w->cache_hits += r->cached;
}

/*
 * The bpf_loop walk's step to the caller, global: verified once, whatever the
 * walk carries. Inside the callback, 6.7+ verifiers (which walk a callback again
 * until its state repeats) went through it 85 times in handle_perf, 20 k of its
 * 40 k instructions (6.18). Its pointers are arguments (struct walk_loop says
 * why); the rule is found by the callback, so that frame_rule's chain of calls
 * does not start from this frame too (512 bytes of stack for the whole chain).
 */
__noinline int frame_step(struct walk *w, struct stack_copy *copy, const struct unwind_rule *rule)
{
	if (!w || !copy || !rule)
		return 1;
	return unwind_step(w, copy, *rule);
}

/* A bpf_loop step: record ip, find its rule, then step to the caller. 1 ends the loop. */
static long walk_frame(__u32 index, void *data)
{
	struct walk_loop *l = data;
	struct frame_rule r = { .last_mapping = ~0U, .rule = { .cfa_kind = BISTOURI_CFA_NONE } };

	if (record_frame(&l->w, l->ev))
		return 1;
	/* The rule stays in r, not copied out: this frame is on the longest chain of the 512 bytes. */
	if (l->w.proc_count) {
		rule_query(&l->w, &r);
		if (!frame_rule(&r))
			r.rule.cfa_kind = BISTOURI_CFA_NONE;
		rule_answer(&l->w, &r);
	}
	/* A global function's result is any int to the verifier; bpf_loop takes 0 or 1. */
	return frame_step(&l->w, l->copy, &r.rule) ? 1 : 0;
}

/*
 * The bounded walk's rule and step, its locals declared after record_frame:
 * 6.1 verifies the bounded twins near its 1 M instructions, and this shape is
 * what was measured (with the locals first, 6.18 took handle_perf_bounded
 * through 536 k instructions instead of 87 k).
 */
static __always_inline long frame_step_bounded(struct walk *w, struct stack_copy *copy)
{
	struct frame_rule r = { .last_mapping = ~0U };
	struct unwind_rule rule = { .cfa_kind = BISTOURI_CFA_NONE };

	if (w->proc_count) {
		rule_query(w, &r);
		/* Copied when found only: a rule known to be NONE spares the verifier the table cases. */
		if (frame_rule_bounded(&r))
			rule = r.rule;
		rule_answer(w, &r);
	}
	return unwind_step(w, copy, rule);
}

/* A step of the bounded loop (no bpf_loop): a static function, verified at each of its calls. */
static __noinline long walk_frame_bounded(struct walk *w, struct bistouri_stack_event *ev, struct stack_copy *copy)
{
	if (record_frame(w, ev))
		return 1;
	return frame_step_bounded(w, copy);
}

/*
 * The user stack as raw IPs, from .eh_frame tables where the process has them
 * and the frame pointer elsewhere. Returns the size in bytes, like bpf_get_stack.
 */
/* Inlined, not a global function: Debian's 6.1 verifier refuses the global version (EACCES). */
static __always_inline long walk_user(struct bistouri_stack_event *ev, struct unwind_regs *start, __u32 copy_slot,
				      bool bounded)
{
	struct walk_loop l = { .ev = ev, .w = { .regs = *start, .exact = true, .last_mapping = ~0U } };
	struct walk *w = &l.w;
	struct bistouri_unwind_proc *proc;
	__u32 zero = 0;
	__u64 *generation;

	if (!start->ip || start->ip > USER_TOP)
		return 0;
	l.copy = bpf_map_lookup_elem(&stack_copies, &copy_slot);
	if (!l.copy)
		return 0;
	w->win.base = w->win.end = start->sp;
	proc = bpf_map_lookup_elem(&unwind_procs, &ev->pid);
	/*
	 * Not Python: fill_stacks skips walk_python (its python_procs lookup, every sample's price).
	 * Not in the bounded twins: the branch doubles the paths 6.1's verifier walks through their
	 * unrolled loops, and handle_sched_switch_bounded then passed its 1 M instructions (E2BIG).
	 */
	if (!bounded && proc && (proc->flags & BISTOURI_UNWIND_PROC_NO_PYTHON))
		ev->py_status = BISTOURI_PY_STATUS_NOT_PYTHON;
	/* Read before the tables: a rule found while user space changes them is cached under the old one. */
	generation = bpf_map_lookup_elem(&unwind_generation, &zero);
	if (proc && generation) {
		w->proc_slot = proc->slot;
		w->proc_count = proc->count;
		w->generation = *generation;
		w->cache_base = copy_slot ? RULE_CACHE_ENTRIES : 0;
	}
	if (bounded) {
		/* Without bpf_loop the verifier walks each iteration: BOUNDED_DEPTH frames at most. */
		for (int i = 0; i < BOUNDED_DEPTH; i++)
			if (walk_frame_bounded(w, ev, l.copy))
				break;
		if (!w->stop && w->n >= BOUNDED_DEPTH)
			w->stop = BISTOURI_CNT_WALK_DEPTH;
	} else {
		bpf_loop(BISTOURI_MAX_DEPTH + 1, walk_frame, &l, 0);
	}
	count_add(BISTOURI_CNT_FRAMES_BY_TABLE, w->by_table);
	count_add(BISTOURI_CNT_FRAMES_BY_FP, w->by_fp);
	count_add(BISTOURI_CNT_RULE_CACHE_HITS, w->cache_hits);
	if (w->stop)
		count(w->stop);
	/* The same, per sample: the session says how its stacks were walked. */
	ev->user_by_table = w->by_table;
	ev->user_by_fp = w->by_fp;
	ev->user_walk_end = w->stop;
	return (long)w->n * sizeof(__u64);
}

#endif /* BISTOURI_UNWIND_BPF_H */
