/*
 * Counts the bytes each caller copies with `memcpy` and `memmove`, for a bench binary run
 * under `LD_PRELOAD`: where a process moves large futures, and how much.
 *
 *   gcc -O2 -shared -fPIC -fno-builtin -o /tmp/copies.so benches/support/copies.c -ldl
 *   LD_PRELOAD=/tmp/copies.so IDEMPOTENT_BENCH_ONLY=layer IDEMPOTENT_BENCH_OPS=2000 \
 *       target/release/deps/http-<hash> --bench
 *
 * At exit it writes `COPIES_OUT` (default `/tmp/copies.out`): a line `small <calls> <bytes>`
 * for the copies under 512 bytes, then `<bytes> <calls> <object> <offset>` for each caller
 * of a larger copy; `addr2line -f -C -e <object> <offset>` names the caller. The copies are
 * made by a plain loop here, so time the binary without it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define SLOTS 4096
#define LARGE 512

static struct {
    void *caller;
    unsigned long calls, bytes;
} table[SLOTS];
static unsigned long small_calls, small_bytes;

static void record(void *caller, size_t n) {
    if (n < LARGE) {
        __atomic_add_fetch(&small_calls, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&small_bytes, n, __ATOMIC_RELAXED);
        return;
    }
    unsigned start = ((uintptr_t)caller >> 2) % SLOTS;
    for (unsigned i = 0; i < SLOTS; i++) {
        unsigned j = (start + i) % SLOTS;
        void *seen = __atomic_load_n(&table[j].caller, __ATOMIC_RELAXED);
        if (seen == NULL) {
            void *empty = NULL;
            if (!__atomic_compare_exchange_n(&table[j].caller, &empty, caller, 0,
                                             __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                seen = empty;
            else
                seen = caller;
        }
        if (seen == caller) {
            __atomic_add_fetch(&table[j].calls, 1, __ATOMIC_RELAXED);
            __atomic_add_fetch(&table[j].bytes, n, __ATOMIC_RELAXED);
            return;
        }
    }
}

static void *copy(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s) {
        for (; n >= 8; n -= 8, d += 8, s += 8) {
            uint64_t word;
            __builtin_memcpy(&word, s, 8);
            __builtin_memcpy(d, &word, 8);
        }
        while (n--)
            *d++ = *s++;
    } else {
        d += n;
        s += n;
        for (; n >= 8; n -= 8) {
            uint64_t word;
            d -= 8;
            s -= 8;
            __builtin_memcpy(&word, s, 8);
            __builtin_memcpy(d, &word, 8);
        }
        while (n--)
            *--d = *--s;
    }
    return dst;
}

void *memcpy(void *dst, const void *src, size_t n) {
    record(__builtin_return_address(0), n);
    return copy(dst, src, n);
}

void *memmove(void *dst, const void *src, size_t n) {
    record(__builtin_return_address(0), n);
    return copy(dst, src, n);
}

__attribute__((destructor)) static void report(void) {
    const char *path = getenv("COPIES_OUT");
    FILE *out = fopen(path ? path : "/tmp/copies.out", "w");
    if (!out)
        return;
    fprintf(out, "small %lu %lu\n", small_calls, small_bytes);
    for (unsigned i = 0; i < SLOTS; i++) {
        if (!table[i].caller)
            continue;
        Dl_info info;
        const char *object = "?";
        uintptr_t offset = (uintptr_t)table[i].caller;
        if (dladdr(table[i].caller, &info)) {
            object = info.dli_fname;
            offset -= (uintptr_t)info.dli_fbase;
        }
        fprintf(out, "%lu %lu %s 0x%lx\n", table[i].bytes, table[i].calls, object,
                (unsigned long)offset);
    }
    fclose(out);
}
