/*
 * dp.h - the DualPath C data plane API, written for cffi first.
 *
 * Everything between DP_CDEF_BEGIN and DP_CDEF_END is parsed by cffi (see
 * dualpath/_native/build.py): opaque handles, caller-allocated structs, fixed-width
 * integers, no macros. Every exported symbol has the dp_ prefix.
 *
 * Return conventions (each function repeats which one it uses):
 *   int        0 on success or -errno.
 *   count      a count >= 0 on success or -errno.
 *   pointer    a handle, or NULL with errno set.
 */
#ifndef DP_H
#define DP_H

#include <stddef.h>
#include <stdint.h>

/* DP_CDEF_BEGIN */

/* The package version this object was built from (a static string; any thread). */
const char *dp_version(void);

/* DP_CDEF_END */

#endif /* DP_H */
