/* version.c - the embedded package version and build-time feature flags. */
#include "dp.h"

#ifndef DP_PKG_VERSION
#error "DP_PKG_VERSION must be defined by the build (dualpath/_native/build.py)"
#endif

const char *dp_version(void) { return DP_PKG_VERSION; }
