// Package bench holds the parts of `kvhost bench` and `kvhost check` that do
// not depend on the daemon's wiring: the benchmark's key layout (which
// blocks of a paged cache each key is stored from and loaded into, and the
// byte-for-byte check of a load), the ceilings measured in the same run
// (plain pread/pwrite of the same files with the same threads, O_DIRECT
// where the mount allows it; with a GPU, the same files staged through
// pinned buffers and the GPU, StagedRead and StagedWrite), the report (a text table, a documented JSON
// document, an SVG chart drawn by a small writer of our own) and a progress
// bar for terminals.
//
// docs/bench.md describes the command, its JSON schema and how to read the
// figures.
package bench
