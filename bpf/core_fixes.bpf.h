/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* CO-RE shims for kernel struct changes, one ___o/___x pair per change. */
#ifndef BISTOURI_CORE_FIXES_BPF_H
#define BISTOURI_CORE_FIXES_BPF_H

#include <bpf/bpf_core_read.h>

/*
 * task_struct::state became task_struct::__state in 5.14
 * (kernel commit 2f064a59a11f, "sched: Change task_struct::state").
 */
struct task_struct___o {
	volatile long int state;
} __attribute__((preserve_access_index));

struct task_struct___x {
	unsigned int __state;
} __attribute__((preserve_access_index));

static __always_inline long get_task_state(void *task)
{
	struct task_struct___x *t = task;

	if (bpf_core_field_exists(t->__state))
		return BPF_CORE_READ(t, __state);
	return BPF_CORE_READ((struct task_struct___o *)task, state);
}

#endif /* BISTOURI_CORE_FIXES_BPF_H */
