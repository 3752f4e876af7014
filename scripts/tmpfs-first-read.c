// tmpfs-first-read: what a first read of freshly written files on a memory
// file system costs against later reads, and where the difference goes.
//
//   gcc -O2 -pthread -o /tmp/tmpfs-first-read scripts/tmpfs-first-read.c
//   /tmp/tmpfs-first-read DIR FILES FILE_MIB THREADS WRITE:READ...
//
// For each WRITE:READ set it writes FILES files of FILE_MIB MiB in DIR
// from THREADS threads (4 MiB pwrite calls), reads them once the READ way,
// then twice more with pread ("reread", "reread2"), and removes them. Each
// phase prints its GB/s and the change in /proc/vmstat counters over it:
// pgactivate counts pages the kernel moved to its active LRU list (a lock
// per batch of pages), thp_collapse_alloc and nr_shmem_hugepages count
// huge pages made.
//
// WRITE: plain (create and write), falloc (fallocate the size first, as
// kvhost's stores do), falloc256 and plain256 (writes of 256 KiB), pcollapse
// (fallocate one page per 2 MiB, then MADV_COLLAPSE the file into huge
// pages before writing it), fcollapse (fallocate all, collapse, write),
// wcollapse (write, then collapse), pconly and fconly (allocate and
// collapse, write nothing), mapw and mapwseq (ftruncate, map and copy into
// the mapping; the second after MADV_SEQUENTIAL).
//
// READ: pread (256 KiB calls), pread4m (4 MiB calls), noreuse (pread after
// POSIX_FADV_NOREUSE), splice (through a pipe), mmap (map and copy),
// mmapmadv (map, MADV_POPULATE_READ, copy), mmaprand and mmapseq (the same
// after MADV_RANDOM or MADV_SEQUENTIAL), mmapnoreuse (after
// POSIX_FADV_NOREUSE), mmapchunk (populate 4 MiB at a time), mmapfault,
// mmapfseq and mmapfrand (map and copy, the pages faulted in by the copy
// itself, none populated; the last two after MADV_SEQUENTIAL or
// MADV_RANDOM), mmapfseqp and mmapfseqgo (mmapfseq copying in 256 KiB
// pieces as kvhost's loads do: with memcpy, or with a loop of 32-byte
// loads and ordinary stores, the kind of copy Go's copy() makes of
// 256 KiB, where glibc's memcpy may use rep movsb or non-temporal
// stores), mmapfseqnt (the same pieces with non-temporal stores), mixedN (every Nth thread preads, the others mmapfseq),
// pop+pread (an untimed-apart
// MADV_POPULATE_READ pass, printed as "poponly", then pread), zero (check
// that every byte is zero: for pconly and fconly).
#define _GNU_SOURCE
#include <errno.h>
#include <immintrin.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

static const char *dir;
static long files, fsize, threads;
static const char *mode;
static int set;
static size_t chunk = 4 << 20, piece = 256 << 10;
static char **bufs;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static void path(char *p, long i) { snprintf(p, 256, "%s/s%d-%05ld", dir, set, i); }

static void die(const char *w) { perror(w); exit(1); }

static void collapse(int fd) {
  if (ftruncate(fd, fsize)) die("ftruncate");
  char *r = mmap(0, fsize + (2 << 20), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r == MAP_FAILED) die("reserve");
  char *al = (char *)(((uintptr_t)r + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  char *m = mmap(al, fsize, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
  if (m == MAP_FAILED) die("mmap w");
  if (madvise(m, fsize, 25 /* MADV_COLLAPSE */)) perror("collapse");
  munmap(r, fsize + (2 << 20));
}

static void *writer(void *a) {
  long t = (long)a;
  char *b = bufs[t];
  char p[256];
  for (long i = t; i < files; i += threads) {
    path(p, i);
    int fd = open(p, O_CREAT | O_TRUNC | O_RDWR, 0644);
    if (fd < 0) die("open w");
    if ((!strcmp(mode, "falloc") || !strcmp(mode, "falloc256")) && fallocate(fd, 0, 0, fsize)) die("fallocate");
    if (!strcmp(mode, "fcollapse") && fallocate(fd, 0, 0, fsize)) die("fallocate");
    if (!strncmp(mode, "pc", 2))
      for (long off = 0; off < fsize; off += 2 << 20)
        if (fallocate(fd, 0, off, 4096)) die("fallocate p");
    if (!strcmp(mode, "fconly") && fallocate(fd, 0, 0, fsize)) die("fallocate");
    if (!strcmp(mode, "collapse") || !strcmp(mode, "fcollapse") || !strncmp(mode, "pc", 2) || !strcmp(mode, "fconly")) collapse(fd);
    if (!strcmp(mode, "pconly") || !strcmp(mode, "fconly")) { close(fd); continue; }
    if (!strncmp(mode, "mapw", 4)) {
      if (ftruncate(fd, fsize)) die("ftruncate");
      char *m = mmap(0, fsize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (m == MAP_FAILED) die("mmap w");
      if (!strcmp(mode, "mapwseq") && madvise(m, fsize, MADV_SEQUENTIAL)) die("madv seq w");
      for (long off = 0; off < fsize; off += chunk) {
        memset(b, (int)(i + off / chunk), 64);
        memcpy(m + off, b, chunk);
      }
      munmap(m, fsize);
      close(fd);
      continue;
    }
    for (long off = 0; off < fsize; off += chunk) {
      memset(b, (int)(i + off / chunk), 64);
      if (strstr(mode, "256")) {
        for (size_t q = 0; q < chunk; q += piece)
          if (pwrite(fd, b + q, piece, off + q) != (ssize_t)piece) die("pwrite p");
      } else if (pwrite(fd, b, chunk, off) != (ssize_t)chunk) die("pwrite");
    }
    if (!strcmp(mode, "wcollapse")) collapse(fd);
    close(fd);
  }
  return 0;
}

static const char *rmode, *read_mode;

// avxcopy copies n bytes (a multiple of 128) with 32-byte unaligned loads,
// 128 bytes a turn, and no rep movsb: with nt 0 ordinary stores, so every
// destination line is read for ownership first; with nt 1 (d 32-byte
// aligned) non-temporal stores, which write the lines without reading
// them and bypass the cache.
__attribute__((target("avx2"))) static void avxcopy(char *d, const char *s, size_t n, int nt) {
  for (size_t i = 0; i < n; i += 128) {
    __m256i v[4];
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_si256((const __m256i *)(s + i + 32 * k));
    for (int k = 0; k < 4; k++) {
      if (nt)
        _mm256_stream_si256((__m256i *)(d + i + 32 * k), v[k]);
      else
        _mm256_storeu_si256((__m256i *)(d + i + 32 * k), v[k]);
    }
  }
  if (nt) _mm_sfence();
}
static volatile uint64_t sink;

static void *reader(void *a) {
  long t = (long)a;
  char *b = bufs[t];
  char p[256];
  uint64_t x = 0;
  const char *rmode = read_mode;
  long every = 0;
  if (!strncmp(rmode, "mixed", 5)) {
    every = atol(rmode + 5);
    rmode = t % every ? "mmapfseq" : "pread";
  }
  for (long i = t; i < files; i += threads) {
    path(p, i);
    int fd = open(p, O_RDONLY);
    if (fd < 0) die("open r");
    if (!strcmp(rmode, "zero")) {
      for (long off = 0; off < fsize; off += chunk) {
        if (pread(fd, b, chunk, off) != (ssize_t)chunk) die("pread z");
        for (size_t k = 0; k < chunk; k++)
          if (b[k]) { fprintf(stderr, "nonzero byte at %ld in %s\n", off + (long)k, p); exit(3); }
      }
    } else if (!strcmp(rmode, "pread") || !strcmp(rmode, "pread4m")) {
      size_t step = !strcmp(rmode, "pread") ? piece : chunk;
      for (long off = 0; off < fsize; off += step)
        if (pread(fd, b + (off % chunk), step, off) != (ssize_t)step) die("pread");
    } else if (!strcmp(rmode, "noreuse")) {
      posix_fadvise(fd, 0, 0, POSIX_FADV_NOREUSE);
      for (long off = 0; off < fsize; off += piece)
        if (pread(fd, b + (off % chunk), piece, off) != (ssize_t)piece) die("pread");
    } else if (!strcmp(rmode, "splice")) {
      int p[2];
      if (pipe(p)) die("pipe");
      if (fcntl(p[1], F_SETPIPE_SZ, 1 << 20) < 0) die("setpipe");
      for (loff_t off = 0; off < fsize;) {
        ssize_t n = splice(fd, &off, p[1], 0, 1 << 20, 0);
        if (n <= 0) die("splice");
        for (ssize_t got = 0; got < n;) {
          ssize_t r = read(p[0], b + got, n - got);
          if (r <= 0) die("pipe read");
          got += r;
        }
      }
      close(p[0]);
      close(p[1]);
    } else {
      int flags = MAP_SHARED;
      if (!strcmp(rmode, "mmapnoreuse")) posix_fadvise(fd, 0, 0, POSIX_FADV_NOREUSE);
      if (!strcmp(rmode, "mmappop")) flags |= MAP_POPULATE;
      char *m = mmap(0, fsize, PROT_READ, flags, fd, 0);
      if (m == MAP_FAILED) die("mmap");
      int pieces = !strcmp(rmode, "mmapfseqp") || !strcmp(rmode, "mmapfseqgo") || !strcmp(rmode, "mmapfseqnt");
      if ((!strcmp(rmode, "mmapfseq") || pieces) && madvise(m, fsize, MADV_SEQUENTIAL)) die("madv fseq");
      if (pieces && fsize % piece) die("mmapfseqp: file size not a multiple of 256 KiB");
      if (!strcmp(rmode, "mmapfrand") && madvise(m, fsize, MADV_RANDOM)) die("madv frand");
      if (!strcmp(rmode, "mmaprand") || !strcmp(rmode, "mmapseq")) {
        if (madvise(m, fsize, !strcmp(rmode, "mmaprand") ? MADV_RANDOM : MADV_SEQUENTIAL)) die("madv rand");
        if (madvise(m, fsize, MADV_POPULATE_READ)) die("madvise");
      }
      if (!strcmp(rmode, "mmapnoreuse") && madvise(m, fsize, MADV_POPULATE_READ)) die("madvise");
      if (!strcmp(rmode, "poponly")) {
        if (madvise(m, fsize, MADV_POPULATE_READ)) die("madvise");
        munmap(m, fsize);
        close(fd);
        continue;
      }
      if (!strcmp(rmode, "mmapmadv") && madvise(m, fsize, MADV_POPULATE_READ)) die("madvise");
      size_t step = pieces ? piece : chunk;
      for (long off = 0; off < fsize; off += step) {
        size_t n = fsize - off < (long)step ? (size_t)(fsize - off) : step;
        if (!strcmp(rmode, "mmapchunk")) madvise(m + off, chunk, MADV_POPULATE_READ);
        if (!strcmp(rmode, "mmapfseqgo") || !strcmp(rmode, "mmapfseqnt"))
          avxcopy(b + (off % chunk), m + off, n, !strcmp(rmode, "mmapfseqnt"));
        else
          memcpy(b + (off % chunk), m + off, n);
      }
      munmap(m, fsize);
    }
    x += b[0];
    close(fd);
  }
  sink += x;
  return 0;
}

static const char *keys[] = {"pgactivate", "pgfault", "thp_file_alloc", "thp_collapse_alloc", "thp_file_fallback", "nr_shmem_hugepages", 0};

static void vm(uint64_t *v) {
  FILE *f = fopen("/proc/vmstat", "r");
  char k[128];
  unsigned long long n;
  for (int i = 0; keys[i]; i++) v[i] = 0;
  if (!f) return;
  while (fscanf(f, "%127s %llu", k, &n) == 2)
    for (int i = 0; keys[i]; i++)
      if (!strcmp(k, keys[i])) v[i] = n;
  fclose(f);
}

static void run(void *(*fn)(void *), const char *label) {
  pthread_t th[256];
  uint64_t a[8], b[8];
  read_mode = rmode;
  vm(a);
  double t0 = now();
  for (long t = 0; t < threads; t++) pthread_create(&th[t], 0, fn, (void *)t);
  for (long t = 0; t < threads; t++) pthread_join(th[t], 0);
  double dt = now() - t0;
  vm(b);
  printf("set %d %-10s %-10s %6.2f GB/s", set, mode, label, files * fsize / dt / 1e9);
  for (int i = 0; keys[i]; i++) printf(" %s=%llu", keys[i], (unsigned long long)(b[i] - a[i]));
  printf("\n");
  fflush(stdout);
}

int main(int argc, char **argv) {
  if (argc < 6) {
    fprintf(stderr, "fr DIR FILES FILE_MIB THREADS WMODE:RMODE...\n");
    return 2;
  }
  dir = argv[1];
  files = atol(argv[2]);
  fsize = atol(argv[3]) << 20;
  threads = atol(argv[4]);
  bufs = calloc(threads, sizeof *bufs);
  for (long t = 0; t < threads; t++) {
    if (posix_memalign((void **)&bufs[t], 4096, chunk)) die("alloc");
    memset(bufs[t], 1, chunk);
  }
  for (int a = 5; a < argc; a++, set++) {
    char spec[64];
    snprintf(spec, sizeof spec, "%s", argv[a]);
    char *c = strchr(spec, ':');
    if (!c) return 2;
    *c = 0;
    mode = spec;
    rmode = c + 1;
    run(writer, "write");
    if (!strncmp(rmode, "pop+", 4)) {
      const char *r = rmode + 4;
      rmode = "poponly";
      run(reader, rmode);
      rmode = r;
    }
    run(reader, rmode);
    rmode = "pread";
    run(reader, "reread");
    run(reader, "reread2");
    char p[256];
    for (long i = 0; i < files; i++) {
      path(p, i);
      unlink(p);
    }
  }
  return 0;
}
