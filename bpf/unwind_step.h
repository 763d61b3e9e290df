/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * One step of the user-stack walk: from a frame's registers and its unwind
 * rule (a row of the .eh_frame tables, or none: the frame pointer), the
 * caller's registers.
 *
 * Pure C on purpose: no map, no helper, no kernel type. It is compiled twice:
 * into the BPF object by unwind.bpf.h, whose reader is its copy of the user
 * stack (bpf_probe_read_user underneath), and for user space by
 * tests/unit/test_unwind_userspace.py, whose reader is a recorded stack window,
 * so the walk's arithmetic is tested without root or a kernel.
 *
 * The includer defines, before including this file:
 *   struct walk, with at least
 *       struct unwind_regs regs;   the frame's registers, replaced by the caller's
 *       __u32 by_table, by_fp;     frames found each way, counted here
 *       __u32 stop;                enum bistouri_counter of why the walk ended
 *       bool exact;                regs.ip is where the thread was, not a return address
 *       bool sp_floor;             aarch64 only: regs.sp is a lower bound (a frame record's step)
 *   struct stack_copy, what unwind_read reads the user stack from (may be
 *       incomplete: it is only passed through),
 *   static long unwind_read(struct walk *w, struct stack_copy *copy, __u64 addr, __u64 *out),
 *       the user-stack word at addr into *out: 0, or non-zero if unreadable.
 * The copy is an argument, not a field of the walk: in BPF the step runs in a
 * global function, which sees a pointer stored in its argument as a number.
 * The step works on the walk's own fields rather than on arguments and a
 * result: written so, the verifier processes what it did when this code was
 * inline in the BPF walk (a result struct or pointers to the counters cost
 * 10 to 90 % more instructions, measured with bench/bench_verifier.py).
 */
#ifndef BISTOURI_UNWIND_STEP_H
#define BISTOURI_UNWIND_STEP_H

#include "unwind_rule.h"

/* Returns 1 if the walk ends at this frame (w->stop says why), else 0. */
static __always_inline long unwind_step(struct walk *w, struct stack_copy *copy, struct unwind_rule rule)
{
	__u64 ip = w->regs.ip, sp = w->regs.sp, bp = w->regs.bp, cfa, ra = 0, saved_bp;
	__u32 kind = rule.cfa_kind, rbp_kind = rule.rbp_kind;
	__s32 cfa_off = rule.cfa_off, rbp_off = rule.rbp_off;
#if defined(__TARGET_ARCH_arm64)
	__u32 ra_kind = rbp_kind >> BISTOURI_RA_KIND_SHIFT;

	rbp_kind &= BISTOURI_RBP_KIND_MASK;
	(void)ip; /* x86-64's .plt and trampoline rules only */
	/*
	 * After a frame record's step SP is only a lower bound: x29 points at the
	 * record, which a function may keep anywhere in its frame (lzma_code: 48
	 * below its CFA). An SP-based row would then read its caller from the wrong
	 * place. Its own frame record places it exactly when the row saves x29 and
	 * x30 side by side (x29 = CFA + rbp_off: the record AAPCS64 has x29 point
	 * at); any other row, the frame record again.
	 */
	if (w->sp_floor && kind == BISTOURI_CFA_RSP &&
	    (rbp_kind != BISTOURI_RBP_AT_CFA || ra_kind != BISTOURI_RA_CFA))
		kind = BISTOURI_CFA_NONE;
#endif

	w->exact = false;
	switch (kind) {
	case BISTOURI_CFA_RSP:
#if defined(__TARGET_ARCH_arm64)
		if (w->sp_floor) {
			cfa = bp - rbp_off; /* x29 at the pair the row says is at CFA + rbp_off */
			break;
		}
#endif
		cfa = sp + cfa_off;
		break;
	case BISTOURI_CFA_RBP:
		cfa = bp + cfa_off;
		break;
#if !defined(__TARGET_ARCH_arm64) /* x86-64's .plt and perf trampolines: no such rows on aarch64 */
	case BISTOURI_CFA_PLT:
		cfa = sp + 8 + ((ip & PLT_ENTRY_MASK) >= (__u64)cfa_off ? CFA_PUSHED : 0);
		break;
	case BISTOURI_CFA_TRAMPOLINE: {
		/*
		 * CPython's perf trampolines: sub $8,%rsp; call *%rcx; add $8,%rsp; ret,
		 * copied end to end every cfa_off bytes; the sub is in effect at offsets
		 * [rbp_off & 0xff, rbp_off >> 8) of a copy.
		 */
		__u64 at = cfa_off > 0 ? (ip - rule.bias) % (__u32)cfa_off : 0;

		cfa = sp + 8 + (at >= (rbp_off & 0xff) && at < ((rbp_off >> 8) & 0xff) ? CFA_PUSHED : 0);
		rbp_kind = BISTOURI_RBP_UNCHANGED;
		break;
	}
#endif
	case BISTOURI_CFA_SIGNAL:
		/* RSP points at the ucontext: its mcontext holds the interrupted registers. */
		if (unwind_read(w, copy, sp + UCONTEXT_RIP_OFF, &ra) || unwind_read(w, copy, sp + UCONTEXT_RSP_OFF, &w->regs.sp) ||
		    unwind_read(w, copy, sp + UCONTEXT_RBP_OFF, &w->regs.bp)) {
			w->stop = BISTOURI_CNT_WALK_READ_FAILED;
			return 1;
		}
#if defined(__TARGET_ARCH_arm64)
		/* The interrupted function may be a leaf: its return address still in x30. */
		if (unwind_read(w, copy, sp + UCONTEXT_LR_OFF, &w->regs.lr)) {
			w->stop = BISTOURI_CNT_WALK_READ_FAILED;
			return 1;
		}
		w->sp_floor = false; /* the interrupted SP itself */
#endif
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
		cfa = bp + FP_CFA_OFF;
		rbp_kind = BISTOURI_RBP_AT_CFA;
		rbp_off = FP_SAVED_RBP_OFF;
		kind = BISTOURI_CFA_NONE;
#if defined(__TARGET_ARCH_arm64)
		ra_kind = BISTOURI_RA_CFA; /* the frame record: x30 beside x29 */
#endif
		break;
	}
#if defined(__TARGET_ARCH_arm64)
	/*
	 * A leaf's CFA may be its SP itself (no call pushed anything): only below
	 * it is wrong. The return address is in x30, at the offset the row gives,
	 * or beside the saved x29; pointer authentication's bits are masked off.
	 */
	if (cfa < sp || cfa > USER_TOP) {
		w->stop = BISTOURI_CNT_WALK_BAD_FRAME;
		return 1;
	}
	if (ra_kind == BISTOURI_RA_LR) {
		ra = w->regs.lr;
	} else if (unwind_read(w, copy, cfa + (ra_kind == BISTOURI_RA_AT_OFF ? rbp_off : rbp_off + RA_AFTER_FP), &ra)) {
		w->stop = BISTOURI_CNT_WALK_READ_FAILED;
		return 1;
	}
	ra &= RA_ADDRESS_MASK;
	w->regs.lr = 0; /* the caller's x30 is gone: the call overwrote it */
	w->sp_floor = kind == BISTOURI_CFA_NONE;
#else
	if (cfa <= sp || cfa > USER_TOP) {
		w->stop = BISTOURI_CNT_WALK_BAD_FRAME;
		return 1;
	}
	if (unwind_read(w, copy, cfa + CFA_RA_OFF, &ra)) {
		w->stop = BISTOURI_CNT_WALK_READ_FAILED;
		return 1;
	}
#endif
	if (rbp_kind == BISTOURI_RBP_AT_CFA) {
		if (unwind_read(w, copy, cfa + rbp_off, &saved_bp)) {
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

#endif /* BISTOURI_UNWIND_STEP_H */
