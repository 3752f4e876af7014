// thread-states: where a process's threads are, sampled from /proc.
//
//   gcc -O2 -o thread-states scripts/thread-states.c
//   thread-states PID OUT [INTERVAL_US]
//
// Every INTERVAL_US microseconds (default 2000) until PID exits, writes one
// line per thread of PID to OUT:
//
//   <CLOCK_REALTIME ns> <tid> R
//   <CLOCK_REALTIME ns> <tid> <S|D|...> <wchan> <kernel stack, innermost first, ';'-joined>
//
// A running or runnable thread (R) has no stack worth reading. The kernel
// stack (/proc/PID/task/TID/stack) needs root; without it the stack is "-".
// This is what perf would tell where perf is missing (the GPU machine has
// none): which threads sleep, and on what, while a benchmark runs.
// scripts/thread-states.py summarizes the samples, within the time windows
// of a Go execution trace (kvhost bench --trace).
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int read_file(const char *path, char *buf, int size) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return -1;
  int n = read(fd, buf, size - 1);
  close(fd);
  if (n < 0) n = 0;
  buf[n] = 0;
  return n;
}

// frames turns "[<0>] name+0x1/0x2\n..." into "name;name;...".
static void frames(char *stack, char *out, int size) {
  int len = 0;
  out[0] = 0;
  for (char *s = stack, *nl; (nl = strchr(s, '\n')) && len < size - 1; s = nl + 1) {
    *nl = 0;
    char *name = strchr(s, ' ');
    name = name ? name + 1 : s;
    char *plus = strchr(name, '+');
    if (plus) *plus = 0;
    len += snprintf(out + len, size - len, "%s;", name);
  }
  if (!out[0]) snprintf(out, size, "-");
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: thread-states PID OUT [INTERVAL_US]\n");
    return 2;
  }
  int pid = atoi(argv[1]);
  int interval = argc > 3 ? atoi(argv[3]) : 2000;
  FILE *out = fopen(argv[2], "w");
  if (!out) {
    perror(argv[2]);
    return 1;
  }
  static char dir[64], path[512], stat[4096], wchan[256], stack[8192], line[8192];
  setvbuf(out, NULL, _IOFBF, 1 << 22);
  snprintf(dir, sizeof dir, "/proc/%d/task", pid);
  long samples = 0;
  for (;;) {
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (read_file(path, stat, sizeof stat) <= 0) break; // the process is gone
    char *end = strrchr(stat, ')');
    if (end && end[1] && end[2] == 'Z') break; // exited, not yet waited for
    DIR *d = opendir(dir);
    if (!d) break;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long now = ts.tv_sec * 1000000000LL + ts.tv_nsec;
    for (struct dirent *e; (e = readdir(d));) {
      if (e->d_name[0] == '.') continue;
      snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
      if (read_file(path, stat, sizeof stat) <= 0) continue;
      char *paren = strrchr(stat, ')'); // the name may hold spaces
      if (!paren || !paren[1] || !paren[2]) continue;
      char state = paren[2];
      if (state == 'R') {
        fprintf(out, "%lld %s R\n", now, e->d_name);
        continue;
      }
      snprintf(path, sizeof path, "%s/%s/wchan", dir, e->d_name);
      if (read_file(path, wchan, sizeof wchan) <= 0) snprintf(wchan, sizeof wchan, "-");
      snprintf(path, sizeof path, "%s/%s/stack", dir, e->d_name);
      if (read_file(path, stack, sizeof stack) < 0) stack[0] = 0;
      frames(stack, line, sizeof line);
      fprintf(out, "%lld %s %c %s %s\n", now, e->d_name, state, wchan, line);
    }
    closedir(d);
    samples++;
    usleep(interval);
  }
  fclose(out);
  fprintf(stderr, "thread-states: %ld samples\n", samples);
  return 0;
}
