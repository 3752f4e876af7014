package main

import (
	"reflect"
	"strings"
	"testing"
)

// A call file in the format of docs/bench/h100-peer-*.txt, every kind of line.
const sampleCalls = `kvhost beside llm-d, 2026-11-24, two calls.

== call 1: kvhost at 20519c0 with --no-gap
llmd 32 MiB store GB/s 25.70 25.30   load 25.17 25.01
  kv-shm32-1.json            store  34.34 GB/s  ceiling pwrite O_DIRECT ↔ pinned 31.5  of link 0.62  direct files 127/256  spares 4.0 GiB  no_gap False  verified 0 GiB
  kv-shm32-1.json            load   49.94 GB/s  ceiling pread O_DIRECT ↔ pinned 29.1  of link 0.91  direct files 256/256  spares 4.0 GiB  no_gap False  verified 8 GiB
lookups, p50/p99 us:
  alone table 60/97 53/95   daemon 172/310 186/321
  beside 16 threads of host loads (29.8-34.5 GB/s):
        table 63/167 65/178  daemon 210/5030 203/4532

== call 2: kvhost at c568fe6
llmd 32 MiB pair 2 store GB/s 23.71 23.68   load 23.18 23.46
llmd disk (ext4, 2 GiB) store+sync GB/s 1.82 1.96   cold load 1.47 1.45
  kv-fresh-sums.json         store sums=off  26.73 GB/s  ceiling pwrite O_DIRECT ↔ pinned 27.3  of link 0.49  direct files 0/256  spares 0.0 GiB  no_gap True  verified 0 GiB
  registered (default, files found at start): 36.86 38.37 GB/s
`

func TestParseCallFileReadsEveryKindOfLine(t *testing.T) {
	f, err := ParseCallFile("calls.txt", sampleCalls)
	if err != nil {
		t.Fatal(err)
	}
	if f.Date != "2026-11-24" || len(f.Calls) != 2 {
		t.Fatalf("date %q, %d calls; want 2026-11-24, 2", f.Date, len(f.Calls))
	}
	c1, c2 := f.Calls[0], f.Calls[1]
	if c1.N != 1 || c1.Commit != "20519c0" || c2.N != 2 || c2.Commit != "c568fe6" {
		t.Errorf("calls %d at %s, %d at %s", c1.N, c1.Commit, c2.N, c2.Commit)
	}
	wantPeer := PeerLine{Line: 4, Label: "32 MiB", Phases: []PeerPhase{{Name: "store", GBps: []float64{25.70, 25.30}}, {Name: "load", GBps: []float64{25.17, 25.01}}}}
	if !reflect.DeepEqual(c1.Peer, []PeerLine{wantPeer}) {
		t.Errorf("call 1 llmd: %+v, want %+v", c1.Peer, wantPeer)
	}
	wantKV := KVLine{Line: 6, Report: "kv-shm32-1.json", Direction: "load", GBps: 49.94, CeilingName: "pread O_DIRECT ↔ pinned", CeilingGBps: 29.1, Link: 0.91}
	if len(c1.KV) != 2 || c1.KV[1] != wantKV {
		t.Errorf("call 1 reports: %+v, want the second %+v", c1.KV, wantKV)
	}
	wantLookups := []LookupLine{
		{Line: 8, Situation: "alone", Table: []P50P99{{60, 97}, {53, 95}}, Daemon: []P50P99{{172, 310}, {186, 321}}},
		{Line: 9, Situation: "beside", Table: []P50P99{{63, 167}, {65, 178}}, Daemon: []P50P99{{210, 5030}, {203, 4532}}},
	}
	if !reflect.DeepEqual(c1.Lookups, wantLookups) {
		t.Errorf("lookups: %+v, want %+v", c1.Lookups, wantLookups)
	}
	if len(c2.Peer) != 2 || c2.Peer[0].Pair != 2 || c2.Peer[0].Label != "32 MiB pair 2" {
		t.Errorf("call 2 llmd pair: %+v", c2.Peer)
	}
	disk := c2.Peer[1]
	if disk.Label != "disk (ext4, 2 GiB)" || disk.phase("store+sync") == nil || !reflect.DeepEqual(disk.phase("cold load").GBps, []float64{1.47, 1.45}) {
		t.Errorf("call 2 llmd disk: %+v", disk)
	}
	if k := c2.KV[0]; k.Sums != "off" || k.GBps != 26.73 || !k.NoGap {
		t.Errorf("call 2 report: %+v", k)
	}
	wantFig := []FigureLine{{Line: 16, Label: "registered (default, files found at start)", GBps: []float64{36.86, 38.37}}}
	if !reflect.DeepEqual(c2.Figure, wantFig) {
		t.Errorf("call 2 figures: %+v, want %+v", c2.Figure, wantFig)
	}
}

func TestParseCallFileRefusesLinesItCannotRead(t *testing.T) {
	for _, tc := range []struct {
		name, text, want string
	}{
		{"bad call header", "== call one: kvhost\n", "calls.txt:1: a call header"},
		{"duplicate call", "== call 1: kvhost at abcdef0\n== call 1: kvhost at abcdef0\n", "call 1 appears twice"},
		{"llmd without load", "== call 1: kvhost at abcdef0\nllmd 32 MiB store GB/s 1 2\n", "calls.txt:2: an llmd line"},
		{"report line cut short", "== call 1: kvhost at abcdef0\n  kv-a.json  store  1.0 GB/s  ceiling x 2.0\n", "calls.txt:2: a report line"},
		{"lookups without daemon", "== call 1: kvhost at abcdef0\n  alone table 1/2 3/4\n", "calls.txt:2: a lookups line"},
		{"beside without its table", "== call 1: kvhost at abcdef0\n  beside loads:\nsomething else\n", "calls.txt:3: the lookups \"beside\" line 2"},
		{"beside at the end", "== call 1: kvhost at abcdef0\n  beside loads:\n", "calls.txt:2: the lookups \"beside\" line has no"},
		{"no call", "just prose\n", "no \"== call N"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseCallFile("calls.txt", tc.text)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
