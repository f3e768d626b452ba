/* Two builds of one small library (VARIANT 1 and 2) for the symbolizer's
 * tests: each is stripped, carries a build-id and a .gnu_debuglink named
 * libleak.debug, and has its debug file beside it (see make.sh). */
#include <stdlib.h>

/* Only in the debug file's symbol table: the stripped object does not export it. */
static __attribute__((noinline)) void *leak_inner(size_t n)
{
    return malloc(n * VARIANT);
}

void *leak_alloc(size_t n)
{
    void *p = leak_inner(n);
    return p;
}
