/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The types of the user-stack walk that both its BPF side and its user-space
 * test build share: the registers a walk carries, one unwind rule, and the
 * frame layout the rules rely on (x86-64's, or aarch64's under
 * __TARGET_ARCH_arm64), each number with where it comes from.
 * Pure C (bistouri.h's __u* types only): see unwind_step.h.
 */
#ifndef BISTOURI_UNWIND_RULE_H
#define BISTOURI_UNWIND_RULE_H

#include "bistouri.h"

#if defined(__TARGET_ARCH_arm64)
/*
 * aarch64 (the walk's "ip/sp/bp" are pc, sp and x29, and lr is x30).
 * The highest user address with 48-bit virtual addresses (Debian's arm64 kernels).
 */
#define USER_TOP 0xffffffffffffULL

/*
 * Bits of a saved x30 that are an address: pointer authentication signs the
 * top bits of a return address it saves; masked, the address itself.
 */
#define RA_ADDRESS_MASK USER_TOP

/*
 * Where the interrupted registers are in a signal frame: SP at the signal
 * trampoline (__kernel_rt_sigreturn) points at struct rt_sigframe
 * (arch/arm64/kernel/signal.c), a 128-byte siginfo then the ucontext
 * (include/uapi/asm-generic/ucontext.h as arm64 lays it: uc_flags 8, uc_link 8,
 * uc_stack 24, uc_sigmask 8, 120 unused bytes, then uc_mcontext aligned to 16:
 * byte 176), whose struct sigcontext (arch/arm64/include/uapi/asm/sigcontext.h)
 * holds fault_address then regs[31], sp, pc: x29 at 8 + 29 * 8 = 240 of it.
 */
#define UCONTEXT_MCONTEXT_OFF (128 + 176)
#define UCONTEXT_RBP_OFF (UCONTEXT_MCONTEXT_OFF + 240) /* x29: 544 */
#define UCONTEXT_LR_OFF (UCONTEXT_MCONTEXT_OFF + 248)  /* x30: 552 */
#define UCONTEXT_RSP_OFF (UCONTEXT_MCONTEXT_OFF + 256) /* sp: 560 */
#define UCONTEXT_RIP_OFF (UCONTEXT_MCONTEXT_OFF + 264) /* pc: 568 */

/*
 * The frame record (AAPCS64 6.2.3): x29 points at the caller's x29 and x30,
 * saved side by side, so with the CFA taken as x29 + 16 (the least it can
 * be) the caller's x29 is 16 below it and the return address 8 below.
 */
#define FP_CFA_OFF 16
#define FP_SAVED_RBP_OFF (-16)
#define CFA_RA_OFF (-8)
#define RA_AFTER_FP 8 /* stp x29, x30: x30 is saved 8 above x29 */
#else
/* x86-64. The highest user address (4-level paging): above it, not a user frame. */
#define USER_TOP 0x7fffffffffffULL

/*
 * Where the interrupted registers are in a signal frame: RSP at the signal
 * trampoline (__restore_rt) points at the struct ucontext, whose uc_mcontext
 * starts at byte 40 (uc_flags 8, uc_link 8, uc_stack 24: include/uapi/asm-generic/ucontext.h),
 * and struct sigcontext_64 (arch/x86/include/uapi/asm/sigcontext.h) holds
 * rbp at 80, rsp at 120 and rip at 128 of it.
 */
#define UCONTEXT_MCONTEXT_OFF 40
#define UCONTEXT_RBP_OFF (UCONTEXT_MCONTEXT_OFF + 80)  /* 120 */
#define UCONTEXT_RSP_OFF (UCONTEXT_MCONTEXT_OFF + 120) /* 160 */
#define UCONTEXT_RIP_OFF (UCONTEXT_MCONTEXT_OFF + 128) /* 168 */

/*
 * The frame-pointer convention (push %rbp; mov %rsp,%rbp): the CFA is 16 above
 * RBP, the caller's RBP is saved 16 below the CFA, and on x86-64 the return
 * address is always the word just below the CFA (the call pushed it).
 */
#define FP_CFA_OFF 16
#define FP_SAVED_RBP_OFF (-16)
#define CFA_RA_OFF (-8)

/*
 * A .plt entry (BISTOURI_CFA_PLT) and the perf trampolines (BISTOURI_CFA_TRAMPOLINE):
 * the return address of the call into it is at RSP, so the CFA is RSP + 8, and
 * 8 more while a push or a `sub $8,%rsp` is in effect.
 */
#define PLT_ENTRY_MASK 15 /* .plt entries are 16 bytes */
#define CFA_PUSHED 8

#endif

/* Registers a user walk starts from and carries from frame to frame. */
struct unwind_regs {
	__u64 ip;
	__u64 sp;
	__u64 bp;
#if defined(__TARGET_ARCH_arm64)
	__u64 lr; /* x30 where it still holds the return address (the first frame, a signal frame's); else 0 */
#endif
};

/*
 * The rule of one PC, as the walk uses it: a row of unwind_rows
 * (struct bistouri_unwind_row) with the mapping's bias. cfa_kind
 * BISTOURI_CFA_NONE (a zeroed rule) means no table covers the PC.
 */
struct unwind_rule {
	__u64 bias;          /* table pc = ip - bias */
	__s32 cfa_off;
	__s32 rbp_off;
	__u32 cfa_kind;      /* enum bistouri_cfa_kind */
	__u32 rbp_kind;      /* enum bistouri_rbp_kind */
};

#endif /* BISTOURI_UNWIND_RULE_H */
