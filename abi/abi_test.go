package abi

import (
	"errors"
	"fmt"
	"testing"
	"unsafe"
)

func TestRecordSizes(t *testing.T) {
	tests := []struct {
		name string
		got  uintptr
		want int
	}{
		{"NamespaceRecord", unsafe.Sizeof(NamespaceRecord{}), NamespaceRecordSize},
		{"NameRecord", unsafe.Sizeof(NameRecord{}), NameRecordSize},
		{"AdmitRecord", unsafe.Sizeof(AdmitRecord{}), AdmitRecordSize},
		{"AccessRecord", unsafe.Sizeof(AccessRecord{}), AccessRecordSize},
		{"EvictRequest", unsafe.Sizeof(EvictRequest{}), EvictHeaderSize},
		{"Victim", unsafe.Sizeof(Victim{}), VictimSize},
		{"MountRecord", unsafe.Sizeof(MountRecord{}), MountRecordSize},
		{"VictimTarget", unsafe.Sizeof(VictimTarget{}), VictimTargetSize},
		{"TickRequest", unsafe.Sizeof(TickRequest{}), TickHeaderSize},
		{"Move", unsafe.Sizeof(Move{}), MoveSize},
		{"RankRecord", unsafe.Sizeof(RankRecord{}), RankRecordSize},
	}
	for _, tt := range tests {
		if int(tt.got) != tt.want {
			t.Errorf("%s: size %d, docs/abi.md says %d", tt.name, tt.got, tt.want)
		}
	}
}

// TestRecordOffsets pins every field offset to the table in docs/abi.md.
func TestRecordOffsets(t *testing.T) {
	var ns NamespaceRecord
	var nm NameRecord
	var ad AdmitRecord
	var ac AccessRecord
	var ev EvictRequest
	var v Victim
	var mr MountRecord
	var vt VictimTarget
	var tr TickRequest
	var mv Move
	var rk RankRecord
	tests := []struct {
		field string
		got   uintptr
		want  uintptr
	}{
		{"NamespaceRecord.NS", unsafe.Offsetof(ns.NS), 0},
		{"NamespaceRecord.Flags", unsafe.Offsetof(ns.Flags), 4},
		{"NamespaceRecord.Fingerprint", unsafe.Offsetof(ns.Fingerprint), 8},
		{"NamespaceRecord.Layers", unsafe.Offsetof(ns.Layers), 16},
		{"NamespaceRecord.KVHeads", unsafe.Offsetof(ns.KVHeads), 20},
		{"NamespaceRecord.HeadSize", unsafe.Offsetof(ns.HeadSize), 24},
		{"NamespaceRecord.DtypeSize", unsafe.Offsetof(ns.DtypeSize), 28},
		{"NamespaceRecord.TokensPerBlock", unsafe.Offsetof(ns.TokensPerBlock), 32},
		{"NamespaceRecord.TokensPerKey", unsafe.Offsetof(ns.TokensPerKey), 36},
		{"NamespaceRecord.TPRank", unsafe.Offsetof(ns.TPRank), 40},
		{"NamespaceRecord.TPSize", unsafe.Offsetof(ns.TPSize), 44},
		{"NamespaceRecord.MountCount", unsafe.Offsetof(ns.MountCount), 48},
		{"NamespaceRecord.ModelLen", unsafe.Offsetof(ns.ModelLen), 52},
		{"NamespaceRecord.KeyBytes", unsafe.Offsetof(ns.KeyBytes), 56},
		{"NamespaceRecord.Model", unsafe.Offsetof(ns.Model), 64},
		{"NamespaceRecord.KeysPerFile", unsafe.Offsetof(ns.KeysPerFile), 192},
		{"NamespaceRecord.Order", unsafe.Offsetof(ns.Order), 196},
		{"NameRecord.NS", unsafe.Offsetof(nm.NS), 0},
		{"NameRecord.KeyLen", unsafe.Offsetof(nm.KeyLen), 4},
		{"NameRecord.KeyHash", unsafe.Offsetof(nm.KeyHash), 8},
		{"NameRecord.Fingerprint", unsafe.Offsetof(nm.Fingerprint), 16},
		{"NameRecord.TPRank", unsafe.Offsetof(nm.TPRank), 24},
		{"NameRecord.MountCount", unsafe.Offsetof(nm.MountCount), 28},
		{"NameRecord.KeyBuf", unsafe.Offsetof(nm.KeyBuf), 32},
		{"NameRecord.Mount", unsafe.Offsetof(nm.Mount), 96},
		{"NameRecord.PathLen", unsafe.Offsetof(nm.PathLen), 100},
		{"NameRecord.PathBuf", unsafe.Offsetof(nm.PathBuf), 112},
		{"AdmitRecord.KeyHash", unsafe.Offsetof(ad.KeyHash), 0},
		{"AdmitRecord.Size", unsafe.Offsetof(ad.Size), 8},
		{"AdmitRecord.Time", unsafe.Offsetof(ad.Time), 16},
		{"AdmitRecord.NS", unsafe.Offsetof(ad.NS), 24},
		{"AdmitRecord.Mount", unsafe.Offsetof(ad.Mount), 28},
		{"AdmitRecord.Admit", unsafe.Offsetof(ad.Admit), 32},
		{"AccessRecord.Entry", unsafe.Offsetof(ac.Entry), 0},
		{"AccessRecord.Time", unsafe.Offsetof(ac.Time), 8},
		{"AccessRecord.Size", unsafe.Offsetof(ac.Size), 16},
		{"AccessRecord.KeyHash", unsafe.Offsetof(ac.KeyHash), 24},
		{"AccessRecord.Kind", unsafe.Offsetof(ac.Kind), 32},
		{"AccessRecord.Mount", unsafe.Offsetof(ac.Mount), 36},
		{"AccessRecord.NS", unsafe.Offsetof(ac.NS), 40},
		{"AccessRecord.Hits", unsafe.Offsetof(ac.Hits), 44},
		{"EvictRequest.Bytes", unsafe.Offsetof(ev.Bytes), 0},
		{"EvictRequest.Time", unsafe.Offsetof(ev.Time), 8},
		{"EvictRequest.Mount", unsafe.Offsetof(ev.Mount), 16},
		{"Victim.Entry", unsafe.Offsetof(v.Entry), 0},
		{"Victim.Score", unsafe.Offsetof(v.Score), 8},
		{"AdmitRecord.Target", unsafe.Offsetof(ad.Target), 36},
		{"MountRecord.Mount", unsafe.Offsetof(mr.Mount), 0},
		{"MountRecord.Flags", unsafe.Offsetof(mr.Flags), 4},
		{"MountRecord.Capacity", unsafe.Offsetof(mr.Capacity), 8},
		{"MountRecord.Used", unsafe.Offsetof(mr.Used), 16},
		{"MountRecord.Free", unsafe.Offsetof(mr.Free), 24},
		{"MountRecord.High", unsafe.Offsetof(mr.High), 32},
		{"MountRecord.Low", unsafe.Offsetof(mr.Low), 40},
		{"MountRecord.Entries", unsafe.Offsetof(mr.Entries), 48},
		{"MountRecord.Class", unsafe.Offsetof(mr.Class), 56},
		{"MountRecord.FSType", unsafe.Offsetof(mr.FSType), 60},
		{"MountRecord.FSName", unsafe.Offsetof(mr.FSName), 64},
		{"MountRecord.Backend", unsafe.Offsetof(mr.Backend), 80},
		{"VictimTarget.Mount", unsafe.Offsetof(vt.Mount), 0},
		{"VictimTarget.Flags", unsafe.Offsetof(vt.Flags), 4},
		{"TickRequest.Time", unsafe.Offsetof(tr.Time), 0},
		{"TickRequest.Interval", unsafe.Offsetof(tr.Interval), 8},
		{"Move.Entry", unsafe.Offsetof(mv.Entry), 0},
		{"Move.Mount", unsafe.Offsetof(mv.Mount), 8},
		{"Move.Flags", unsafe.Offsetof(mv.Flags), 12},
		{"RankRecord.Entry", unsafe.Offsetof(rk.Entry), 0},
		{"RankRecord.Time", unsafe.Offsetof(rk.Time), 8},
		{"RankRecord.Rank", unsafe.Offsetof(rk.Rank), 16},
		{"RankRecord.State", unsafe.Offsetof(rk.State), 24},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s at offset %d, docs/abi.md says %d", tt.field, tt.got, tt.want)
		}
	}
}

func TestCheckPath(t *testing.T) {
	long := make([]byte, MaxPathLen+1)
	for i := range long {
		long[i] = 'a'
	}
	tests := []struct {
		path string
		ok   bool
	}{
		{"a", true},
		{"model_0123/ab/cd_g0/abcdef.bin", true},
		{"A-Z_0.9/x", true},
		{string(long[:MaxPathLen]), true},
		{"", false},
		{string(long), false},
		{"/etc/passwd", false},
		{"../x", false},
		{"a/../../x", false},
		{"a/./b", false},
		{"a//b", false},
		{"a/", false},
		{".tmp", false},
		{"a/.hidden", false},
		{"a b", false},
		{"a\\b", false},
		{"a\x00b", false},
		{"caf\xc3\xa9", false},
	}
	for _, tt := range tests {
		err := CheckPath([]byte(tt.path))
		if (err == nil) != tt.ok {
			t.Errorf("CheckPath(%q) = %v, want ok=%v", tt.path, err, tt.ok)
		}
		var pe *PathError
		if err != nil && !errors.As(err, &pe) {
			t.Errorf("CheckPath(%q) error %T is not a *PathError", tt.path, err)
		}
	}
}

// TestPathClass: the class table CheckPath reads gives every byte the
// bits of the rule it states: allowed for [A-Za-z0-9._-/], slash for '/',
// start for '/' and '.'.
func TestPathClass(t *testing.T) {
	for c := range 256 {
		b := byte(c)
		var want byte
		if b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '.' || b == '_' || b == '-' || b == '/' {
			want |= classAllowed
		}
		if b == '/' {
			want |= classSlash
		}
		if b == '/' || b == '.' {
			want |= classStart
		}
		if pathClass[c] != want {
			t.Errorf("byte %#02x: class %#x, want %#x", c, pathClass[c], want)
		}
	}
}

// TestCheckPathSaysWhatTheRuleSays: on paths that break each rule, at the
// start, in the middle and at the end, CheckPath fails as checkPath, the
// rule one byte at a time, does, with the same reason.
func TestCheckPathSaysWhatTheRuleSays(t *testing.T) {
	for _, p := range []string{"", "a", "/", "//", ".", "a.", "a/.", "./a", "a/", "a//", "ab/c/d.kv", "a/b c", "\xff", "a/\x00",
		"model_0123/ab/cd/6b657931.kv", "model/.x/y", "model/x/", "x/-a/_b/.c"} {
		err, slow := CheckPath([]byte(p)), checkPath([]byte(p))
		if fmt.Sprint(err) != fmt.Sprint(slow) {
			t.Errorf("CheckPath(%q) = %v, checkPath says %v", p, err, slow)
		}
	}
}

func TestKeyHash(t *testing.T) {
	// FNV-1a 64 reference values.
	tests := []struct {
		in   string
		want uint64
	}{
		{"", 0xcbf29ce484222325},
		{"a", 0xaf63dc4c8601ec8c},
		{"foobar", 0x85944171f73967e8},
	}
	for _, tt := range tests {
		if got := KeyHash([]byte(tt.in)); got != tt.want {
			t.Errorf("KeyHash(%q) = %#x, want %#x", tt.in, got, tt.want)
		}
	}
}

func TestViewAliases(t *testing.T) {
	b := AlignedBuffer(2 * AccessRecordSize)
	recs := View[AccessRecord](b, 2)
	recs[1].Entry = 0x0102030405060708
	if b[AccessRecordSize] != 0x08 || b[AccessRecordSize+7] != 0x01 {
		t.Fatalf("View does not alias little-endian bytes: % x", b[AccessRecordSize:AccessRecordSize+8])
	}
	defer func() {
		if recover() == nil {
			t.Fatal("View past the end did not panic")
		}
	}()
	View[AccessRecord](b, 3)
}

func TestStatusAndFeatureStrings(t *testing.T) {
	if got := StatusNoMemory.String(); got != "no memory" {
		t.Errorf("StatusNoMemory = %q", got)
	}
	if got := Status(-99).String(); got != "status(-99)" {
		t.Errorf("Status(-99) = %q", got)
	}
	if got := (FeatureAdmit | FeatureNamespace | 1<<9).String(); got != "namespace,admit,unknown(0x200)" {
		t.Errorf("features = %q", got)
	}
	if got := (FeatureMounts | FeatureAdmitMount | FeatureDemote | FeatureTick).String(); got != "mounts,admit-mount,demote,tick" {
		t.Errorf("tiering features = %q", got)
	}
	if got := (FeatureRank | 1<<9).String(); got != "rank,unknown(0x200)" {
		t.Errorf("rank feature = %q", got)
	}
}

// TestScratchHoldsTieringInputs: the v1 scratch size holds every input and
// output of the tiering hooks, so a plugin that declares them needs no
// larger area.
func TestScratchHoldsTieringInputs(t *testing.T) {
	for _, tt := range []struct {
		name string
		need int
	}{
		{"mounts", MaxMounts * MountRecordSize},
		{"evict with targets", EvictTargetsOffset + MaxBatch*VictimTargetSize},
		{"tick", TickHeaderSize + MaxBatch*MoveSize},
		{"rank", MaxBatch * RankRecordSize},
	} {
		if tt.need > ScratchSize {
			t.Errorf("%s needs %d bytes, more than ScratchSize %d", tt.name, tt.need, ScratchSize)
		}
	}
	if EvictTargetsOffset%ScratchAlign != 0 {
		t.Errorf("EvictTargetsOffset %d is not aligned", EvictTargetsOffset)
	}
}

func FuzzCheckPath(f *testing.F) {
	for _, s := range []string{"a/b.bin", "../x", "/abs", "a//b", ".tmp", "a/b/"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		err := CheckPath(p)
		if slow := checkPath(p); fmt.Sprint(err) != fmt.Sprint(slow) {
			t.Fatalf("CheckPath(%q) = %v, but the rule one byte at a time says %v", p, err, slow)
		}
		if err != nil {
			return
		}
		// An accepted path never escapes its root and never names a host file.
		if p[0] == '/' || len(p) > MaxPathLen {
			t.Fatalf("accepted %q", p)
		}
		for i := range p {
			if p[i] == '.' && (i == 0 || p[i-1] == '/') {
				t.Fatalf("accepted dot component in %q", p)
			}
		}
	})
}

// BenchmarkCheckPath measures CheckPath on a name of the built-in
// policies (39 bytes, the boundary benchmark's; 102 with a 32-byte key)
// against checkPath, the rule one byte at a time, on the same bytes.
func BenchmarkCheckPath(b *testing.B) {
	for _, p := range []string{"model_0000feedface_r0/3a/9f/006b6579.kv",
		"Llama-3.1-8B_0000feedface_r0/3a/9f/00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff.kv"} {
		for _, f := range []struct {
			name  string
			check func([]byte) error
		}{{"CheckPath", CheckPath}, {"one-byte-at-a-time", checkPath}} {
			b.Run(fmt.Sprintf("%s/len=%d", f.name, len(p)), func(b *testing.B) {
				path := []byte(p)
				for b.Loop() {
					if err := f.check(path); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(p)), "ns/byte")
			})
		}
	}
}
