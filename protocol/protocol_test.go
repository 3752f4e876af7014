package protocol

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func sampleMessages() []Message {
	var h [CUDAIPCHandleLen]byte
	h[3] = 7
	return []Message{
		&Hello{Version: Version, Client: "test"},
		&Welcome{Version: 1, MaxFrame: 1 << 20, MaxRegistrations: 64, MaxInflightJobs: 8, MaxNamespaces: 16, MaxCaches: 16, MaxKeys: MaxKeysPerRequest, MaxKeyLen: MaxKeyLen, Server: "kvhost"},
		&Welcome{Version: 1, MaxFrame: 1 << 30, Server: "the largest max frame"},
		&Welcome{Version: 1, MaxFrame: 64 << 10, Server: "the smallest max frame"},
		&RegisterMemory{Kind: MemoryMemfd, Size: 4096},
		&RegisterMemory{Kind: MemoryCUDAIPC, Size: 1 << 30, Device: 3, Offset: 512, Handle: h},
		&RegisterMemory{Kind: MemoryShared, Size: 1 << 20},
		&MemoryRegistered{Region: 2, Inode: 99},
		&UnregisterMemory{Region: 1},
		&Declare{Geometry: Geometry{Model: "llama", Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2, MLA: true, TokensPerBlock: 16, TokensPerKey: 256, TPRank: 1, TPSize: 2}},
		&Declared{NS: 1, BlocksPerKey: 16, Fingerprint: 1 << 60, KeyBytes: 1 << 20},
		&RegisterCache{NS: 1, Layers: []Layer{{Region: 1, NumBlocks: 10, Offset: 8, BlockStride: 64, PlaneStride: 640}, {Region: 2, NumBlocks: 1}}},
		&CacheRegistered{Cache: 3},
		&UnregisterCache{Cache: 3},
		&Undeclare{NS: 4},
		&Empty{T: TypeUndeclare | TypeReply},
		&Lookup{NS: 1, Keys: [][]byte{[]byte("a"), bytes.Repeat([]byte{1}, MaxKeyLen)}},
		&Count{T: TypeLookup | TypeReply, Count: 2},
		&Transfer{Kind: JobStore, Cache: 1, Keys: [][]byte{[]byte("k1"), []byte("k2")}, Blocks: [][]uint32{{1, 2}, {3, 4}}},
		&Transfer{Kind: JobLoad, Cache: 1, Keys: [][]byte{[]byte("k1")}, Blocks: [][]uint32{{9}}},
		&Transfer{Kind: JobLoad, Cache: 1, Keys: [][]byte{[]byte("k1")}, Blocks: [][]uint32{{NoBlock, 9, NoBlock}}},
		&JobAccepted{T: TypeStore | TypeReply, Job: 42},
		&Cancel{Job: 42},
		&Cancelled{InFlight: true},
		&Delete{NS: 2, Keys: [][]byte{[]byte("x")}},
		&Count{T: TypeDelete | TypeReply, Count: 1},
		&StatsRequest{},
		&Stats{Entries: 1, BytesRead: 7, InflightJobs: 3, Mounts: []MountStats{{Capacity: 10, Used: 5, Entries: 1, Direct: true}},
			Devices: []DeviceStats{{Ordinal: 0, Regions: 2, Registered: 3 << 30, Limit: 64 << 30}, {Ordinal: 7, Limit: 1}}},
		&Stats{Clients: 2, Mounts: []MountStats{{Capacity: 10}}, Daemon: &DaemonStats{Started: 1 << 60, Policy: "lru", PolicyBackend: "native",
			Fallback: true, FallbackReason: "trap", Reloads: 3, ReloadFailures: 1, LastReload: "ok; needs restart: server.socket",
			InflightJobs: 4, Regions: 5, RegisteredBytes: 6 << 20, Mounts: []MountInfo{{Path: "/nvme/kv", Backend: "staging", IO: "direct", Checksums: true, Configured: 1 << 40, Reserve: 1 << 30}}}},
		&Stats{Mounts: []MountStats{{Capacity: 10}}, Daemon: &DaemonStats{Policy: "lru", FallbackPolicy: "tiered", Mounts: []MountInfo{{Path: "/dev/shm/kv"}}},
			Spares: &SpareStats{Reused: 9, Mounts: []SpareMount{{Files: 4, Bytes: 4 << 21}}},
			Tiering: &TierStats{Demotions: 74700, Promotions: 3, Moves: 4, MoveFailures: 5, DemotionDeletes: 6,
				Mounts: []TierMount{{MovedIn: 7, MovedOut: 8}}, FallbackPolicy: "tiered"},
			StoresFailing: []MountFailure{{Since: 1 << 60, Last: 1<<60 + 5, Stores: 3, Err: "engine: store on mount /dev/shm/kv: open: read-only file system"}}},
		&Stats{Mounts: []MountStats{{Capacity: 10}, {}}, Daemon: &DaemonStats{Mounts: []MountInfo{{}, {}}}, Spares: &SpareStats{Mounts: []SpareMount{{}, {}}},
			Tiering: &TierStats{Mounts: []TierMount{{}, {}}}, StoresFailing: []MountFailure{{}, {Since: 1, Last: 2, Err: "no room (found at start)"}}},
		&Stats{Mounts: []MountStats{{Capacity: 10}}, Daemon: &DaemonStats{Mounts: []MountInfo{{}}}, Spares: &SpareStats{Mounts: []SpareMount{{}}},
			Tiering: &TierStats{Mounts: []TierMount{{}}}, StoresFailing: []MountFailure{{}},
			Namespaces: &NamespaceList{LeftOut: 3, List: []NamespaceStats{
				{Fingerprint: 0xfeed, Model: "vllm:meta-llama/Llama-3.1-8B:0123456789abcdef", Declared: true, Files: 2, Keys: 32, Bytes: 64 << 20, Caches: 2},
				{Fingerprint: 1, Files: 1, Keys: 1, Bytes: 4096}}}},
		&Stats{Mounts: []MountStats{{}}, Daemon: &DaemonStats{Mounts: []MountInfo{{}}}, Spares: &SpareStats{Mounts: []SpareMount{{}}},
			Tiering: &TierStats{Mounts: []TierMount{{}}}, StoresFailing: []MountFailure{{}}, Namespaces: &NamespaceList{}},
		&Stats{Devices: []DeviceStats{{Ordinal: 0, UUID: [16]byte{1, 2, 3, 15: 4}}, {Ordinal: 1}},
			Daemon: &DaemonStats{Policy: "lru"}, Spares: &SpareStats{}},
		&Empty{T: TypeUnregisterCache | TypeReply},
		&Empty{T: TypeUnregisterMemory | TypeReply},
		&JobAccepted{T: TypeLoad | TypeReply, Job: 43},
		&Error{Code: CodeLimit, Message: "too many"},
		&Error{Code: CodeTimeout, Message: "no hello within 5s"},
		&Completion{Job: 42, Kind: JobLoad, Bytes: 100, Duration: 5, Keys: []KeyOutcome{{OutcomeLoaded, 0}, {OutcomeFailed, CodeCorrupt}}, Message: "bad crc"},
	}
}

func TestRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		t.Run(m.Type().String(), func(t *testing.T) {
			frame := AppendFrame(nil, 77, m)
			h, err := ParseHeader(frame, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			if h.Type != m.Type() || h.ID != 77 || int(h.Len) != len(frame)-HeaderSize {
				t.Fatalf("header %+v", h)
			}
			got, err := Decode(h.Type, frame[HeaderSize:])
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, m) {
				t.Fatalf("decoded %#v, want %#v", got, m)
			}
		})
	}
}

func TestRejects(t *testing.T) {
	body := func(m Message) []byte { return m.AppendBody(nil) }
	hello := body(&Hello{Version: 1})
	badMagic := append([]byte{}, hello...)
	badMagic[0] = 'X'
	store := body(&Transfer{Kind: JobStore, Cache: 1, Keys: [][]byte{[]byte("k")}, Blocks: [][]uint32{{1, 2}}})
	cases := []struct {
		name string
		t    Type
		body []byte
	}{
		{"hello short", TypeHello, hello[:5]},
		{"hello magic", TypeHello, badMagic},
		{"trailing", TypeCancel, append(body(&Cancel{Job: 1}), 0)},
		{"zero keys", TypeLookup, []byte{1, 0, 0, 0, 0, 0, 0, 0}},
		{"key too long", TypeLookup, append([]byte{1, 0, 0, 0, 1, 0, 0, 0, MaxKeyLen + 1}, make([]byte, MaxKeyLen+1)...)},
		{"empty key", TypeLookup, []byte{1, 0, 0, 0, 1, 0, 0, 0, 0}},
		{"huge key count", TypeLookup, []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f, 1, 'a'}},
		{"store short blocks", TypeStore, store[:len(store)-1]},
		{"store zero bpk", TypeStore, append([]byte{1, 0, 0, 0, 0, 0, 0, 0}, store[8:]...)},
		{"memory kind", TypeRegisterMemory, append([]byte{9}, body(&RegisterMemory{Kind: MemoryMemfd, Size: 1})[1:]...)},
		{"memory size 0", TypeRegisterMemory, body(&RegisterMemory{Kind: MemoryMemfd})},
		{"memfd with offset", TypeRegisterMemory, body(&RegisterMemory{Kind: MemoryMemfd, Size: 1, Offset: 1})},
		{"shared file with device", TypeRegisterMemory, body(&RegisterMemory{Kind: MemoryShared, Size: 1, Device: 1})},
		{"stats device count past the body", TypeStats | TypeReply, append(body(&Stats{})[:len(body(&Stats{}))-4], 1, 0, 0, 0)},
		{"negative offset", TypeRegisterCache, body(&RegisterCache{NS: 1, Layers: []Layer{{Offset: -1}}})},
		{"no layers", TypeRegisterCache, body(&RegisterCache{NS: 1})},
		{"mla 2", TypeDeclare, append(body(&Declare{})[:1+16], append([]byte{2, 0, 0, 0}, make([]byte, 16)...)...)},
		{"error code 0", TypeError, body(&Error{})},
		{"welcome max frame below 64 KiB", TypeHello | TypeReply, body(&Welcome{Version: Version, MaxFrame: 64<<10 - 1})},
		{"welcome max frame above 1 GiB", TypeHello | TypeReply, body(&Welcome{Version: Version, MaxFrame: 1<<30 + 1})},
		{"completion key pending", TypeCompletion, body(&Completion{Job: 1, Kind: JobStore, Keys: []KeyOutcome{{OutcomeStored, CodeOK}, {OutcomePending, CodeOK}}})},
		{"completion key failed without a code", TypeCompletion, body(&Completion{Job: 1, Kind: JobLoad, Keys: []KeyOutcome{{OutcomeFailed, CodeOK}}})},
		{"completion key cancelled without a code", TypeCompletion, body(&Completion{Job: 1, Kind: JobLoad, Keys: []KeyOutcome{{OutcomeCancelled, CodeOK}}})},
		{"unknown type", Type(0x0777), nil},
		{"stats body", TypeStats | TypeReply, []byte{0}},
		{"stats daemon section cut short", TypeStats | TypeReply, append(body(&Stats{}), 1, 2, 3)},
		{"stats spares section cut short", TypeStats | TypeReply, append(body(&Stats{Daemon: &DaemonStats{}}), 1, 2, 3)},
		{"stats spares mounts past the body", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}})
			b[len(b)-4-8-4-4] = 2 // two mounts, 16 bytes left for them (the identities, the made-ahead count and the faults)
			return b
		}()},
		{"stats device identities for fewer devices", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Devices: []DeviceStats{{Ordinal: 0}, {Ordinal: 1}}, Daemon: &DaemonStats{}, Spares: &SpareStats{}})
			b[len(b)-(4+2*8)-8-2*16-4] = 1 // one identity for two devices
			return b
		}()},
		{"stats device identity cut short", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Devices: []DeviceStats{{Ordinal: 0}}, Daemon: &DaemonStats{}, Spares: &SpareStats{}})
			return b[:len(b)-(4+8)-8-1]
		}()},
		{"stats made-ahead section cut short", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Devices: []DeviceStats{{Ordinal: 0}}, Daemon: &DaemonStats{}, Spares: &SpareStats{}})
			return b[:len(b)-(4+8)-1]
		}()},
		{"stats device faults for fewer devices", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Devices: []DeviceStats{{Ordinal: 0}, {Ordinal: 1}}, Daemon: &DaemonStats{}, Spares: &SpareStats{}})
			b[len(b)-2*8-4] = 1 // faults of one device for two
			return b
		}()},
		{"stats device faults cut short", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Devices: []DeviceStats{{Ordinal: 0}}, Daemon: &DaemonStats{}, Spares: &SpareStats{}})
			return b[:len(b)-1]
		}()},
		{"stats daemon section for fewer mounts", TypeStats | TypeReply, body(&Stats{Mounts: []MountStats{{}}, Daemon: &DaemonStats{}})},
		{"stats daemon section for more mounts", TypeStats | TypeReply, body(&Stats{Daemon: &DaemonStats{Mounts: []MountInfo{{}}}})},
		{"stats spares section for fewer mounts", TypeStats | TypeReply,
			body(&Stats{Mounts: []MountStats{{}}, Daemon: &DaemonStats{Mounts: []MountInfo{{}}}, Spares: &SpareStats{}})},
		{"stats tiering section for more mounts", TypeStats | TypeReply,
			body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{Mounts: []TierMount{{}}}})},
		{"stats mount-failures section for more mounts", TypeStats | TypeReply,
			body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{{}}})},
		{"stats mount-failures section cut short", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Mounts: []MountStats{{}}, Daemon: &DaemonStats{Mounts: []MountInfo{{}}}, Spares: &SpareStats{Mounts: []SpareMount{{}}},
				Tiering: &TierStats{Mounts: []TierMount{{}}}, StoresFailing: []MountFailure{{Err: "read-only file system"}}})
			return b[:len(b)-1]
		}()},
		{"stats namespaces over the bound", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{}})
			b = binary.LittleEndian.AppendUint32(b, MaxStatsNamespaces+1)
			return append(b, make([]byte, 8+(MaxStatsNamespaces+1)*41)...)
		}()},
		{"stats namespaces section cut short", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{},
				Namespaces: &NamespaceList{List: []NamespaceStats{{Model: "m"}}}})
			return b[:len(b)-8-1] // into the model, before the caches section
		}()},
		{"stats caches section cut short", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{},
				Namespaces: &NamespaceList{List: []NamespaceStats{{Model: "m", Caches: 1}}}})
			return b[:len(b)-1]
		}()},
		{"stats caches section of another count", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{},
				Namespaces: &NamespaceList{List: []NamespaceStats{{Model: "m", Caches: 1}}}})
			b[len(b)-8] = 2 // the caches count, before the one namespace's u32
			return b
		}()},
		{"stats namespace declared 2", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{},
				Namespaces: &NamespaceList{List: []NamespaceStats{{}}}})
			b[len(b)-1-8-8] = 2 // the declared byte, before 7 zeros, the empty model and the caches section
			return b
		}()},
		{"stats daemon fallback 2", TypeStats | TypeReply, func() []byte {
			b := body(&Stats{Daemon: &DaemonStats{}})
			b[len(body(&Stats{}))+8+2] = 2 // after the start time and two empty names
			return b
		}()},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Decode(c.t, c.body)
			if err == nil {
				t.Fatal("decoded")
			}
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnknownType) {
				t.Fatalf("error %v does not wrap a package sentinel", err)
			}
		})
	}
}

// TestStatsIgnoresSectionsItDoesNotKnow: bytes after the last section it
// knows (classes; a later daemon's sections) are ignored, and
// everything before them decodes as before.
func TestStatsIgnoresSectionsItDoesNotKnow(t *testing.T) {
	want := &Stats{Clients: 2, Mounts: []MountStats{{Capacity: 10}},
		Daemon:        &DaemonStats{Policy: "lru", Mounts: []MountInfo{{Path: "/kv", Class: "ssd"}}, Budgets: []BudgetStats{{Model: "m", Used: 1}}},
		Devices:       []DeviceStats{{Ordinal: 0, UUID: [16]byte{7}, Faults: 1}},
		Spares:        &SpareStats{Reused: 3, Mounts: []SpareMount{{Files: 2, Bytes: 1 << 21}}, Made: 4},
		Tiering:       &TierStats{Demotions: 5, Mounts: []TierMount{{MovedIn: 1}}},
		StoresFailing: []MountFailure{{Since: 1, Last: 2, Stores: 3, Err: "eio"}},
		Namespaces:    &NamespaceList{List: []NamespaceStats{{Fingerprint: 9, Model: "m", Declared: true, Files: 1, Keys: 2, Bytes: 3, Caches: 4}}}}
	b := append(want.AppendBody(nil), 0xde, 0xad, 0xbe, 0xef)
	got, err := Decode(TypeStats|TypeReply, b)
	if err != nil {
		t.Fatalf("a reply with a later section: %v", err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded %+v, want %+v", got, want)
	}
}

// TestStatsOfADaemonBeforeTheCachesSectionCountsNone: a reply that ends
// after the namespaces section (a daemon that predates the caches
// section) decodes, its namespaces with 0 caches.
func TestStatsOfADaemonBeforeTheCachesSectionCountsNone(t *testing.T) {
	want := &Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{},
		Namespaces: &NamespaceList{List: []NamespaceStats{{Fingerprint: 9, Model: "m", Files: 1}}}}
	b := want.AppendBody(nil)
	got, err := Decode(TypeStats|TypeReply, b[:len(b)-8]) // without the caches section
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded %+v, want %+v", got, want)
	}
}

// TestStatsOfADaemonBeforeTieringHasNoTierStats: a reply that ends after
// the device-faults section (a daemon that predates the tiering section)
// decodes, with no tiering section.
func TestStatsOfADaemonBeforeTieringHasNoTierStats(t *testing.T) {
	want := &Stats{Mounts: []MountStats{{Capacity: 10}}, Daemon: &DaemonStats{Policy: "lru", Mounts: []MountInfo{{Path: "/kv"}}},
		Spares: &SpareStats{Mounts: []SpareMount{{Files: 1}}}}
	got, err := Decode(TypeStats|TypeReply, want.AppendBody(nil))
	if err != nil {
		t.Fatal(err)
	}
	if st := got.(*Stats); st.Tiering != nil || st.StoresFailing != nil {
		t.Fatalf("tiering section %+v, mount failures %+v from a reply without them", st.Tiering, st.StoresFailing)
	}
}

// TestStatsOfADaemonBeforeMountFailuresHasNone: a reply that ends after
// the tiering section (a daemon that predates the mount-failures
// section) decodes, with StoresFailing nil: unknown, not "none failing".
func TestStatsOfADaemonBeforeMountFailuresHasNone(t *testing.T) {
	want := &Stats{Mounts: []MountStats{{Capacity: 10}}, Daemon: &DaemonStats{Policy: "lru", Mounts: []MountInfo{{Path: "/kv"}}},
		Spares: &SpareStats{Mounts: []SpareMount{{Files: 1}}}, Tiering: &TierStats{Mounts: []TierMount{{}}}}
	got, err := Decode(TypeStats|TypeReply, want.AppendBody(nil))
	if err != nil {
		t.Fatal(err)
	}
	if st := got.(*Stats); st.StoresFailing != nil || !reflect.DeepEqual(st, want) {
		t.Fatalf("decoded %+v, want %+v without mount failures", st, want)
	}
}

// TestStatsOfADaemonBeforeNamespacesHasNone: a reply that ends after the
// mount-failures section (a daemon that predates the namespaces section)
// decodes, with Namespaces nil: unknown, not "none stored".
func TestStatsOfADaemonBeforeNamespacesHasNone(t *testing.T) {
	want := &Stats{Mounts: []MountStats{{Capacity: 10}}, Daemon: &DaemonStats{Policy: "lru", Mounts: []MountInfo{{Path: "/kv"}}},
		Spares: &SpareStats{Mounts: []SpareMount{{Files: 1}}}, Tiering: &TierStats{Mounts: []TierMount{{}}}, StoresFailing: []MountFailure{{}}}
	got, err := Decode(TypeStats|TypeReply, want.AppendBody(nil))
	if err != nil {
		t.Fatal(err)
	}
	if st := got.(*Stats); st.Namespaces != nil || !reflect.DeepEqual(st, want) {
		t.Fatalf("decoded %+v, want %+v without namespaces", st, want)
	}
}

// TestStatsListsAtMostMaxStatsNamespaces: a list longer than the bound is
// sent cut to its first MaxStatsNamespaces, the rest counted as left out.
func TestStatsListsAtMostMaxStatsNamespaces(t *testing.T) {
	list := make([]NamespaceStats, MaxStatsNamespaces+5)
	for i := range list {
		list[i] = NamespaceStats{Fingerprint: uint64(i), Model: strings.Repeat("m", MaxModelLen), Keys: 1}
	}
	m := &Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{},
		Namespaces: &NamespaceList{List: list, LeftOut: 2}}
	b := m.AppendBody(nil)
	if len(b) > MinFrame-HeaderSize {
		t.Fatalf("a reply of %d namespaces is %d bytes, more than the smallest frame's body", MaxStatsNamespaces, len(b))
	}
	got, err := Decode(TypeStats|TypeReply, b)
	if err != nil {
		t.Fatal(err)
	}
	nl := got.(*Stats).Namespaces
	if len(nl.List) != MaxStatsNamespaces || nl.LeftOut != 7 || !reflect.DeepEqual(nl.List, list[:MaxStatsNamespaces]) {
		t.Fatalf("decoded %d namespaces, %d left out; want %d, 7", len(nl.List), nl.LeftOut, MaxStatsNamespaces)
	}
}

// TestNamespaceBytesAreTheEncodedSizes: EmptyNamespacesBytes and
// NamespaceBytes, by which the server fits the section into a frame, are
// what the encoding takes.
func TestNamespaceBytesAreTheEncodedSizes(t *testing.T) {
	base := &Stats{Daemon: &DaemonStats{}, Spares: &SpareStats{}, Tiering: &TierStats{}, StoresFailing: []MountFailure{}}
	without := len(base.AppendBody(nil))
	list := []NamespaceStats{{Model: ""}, {Model: "m", Declared: true}, {Model: strings.Repeat("x", MaxModelLen), Keys: 1 << 40}}
	for n := 0; n <= len(list); n++ {
		m := *base
		m.Namespaces = &NamespaceList{List: list[:n]}
		want := without + EmptyNamespacesBytes
		for _, ns := range list[:n] {
			want += NamespaceBytes(ns)
		}
		if got := len(m.AppendBody(nil)); got != want {
			t.Fatalf("%d namespaces: %d bytes encoded, the sizes say %d", n, got, want)
		}
	}
}

// TestStatsOfADaemonBeforeDeviceIdentitiesHasNoUUIDs: a reply that ends
// after the spares section (a daemon that predates the device-identity
// section) decodes, with every device's UUID zero.
func TestStatsOfADaemonBeforeDeviceIdentitiesHasNoUUIDs(t *testing.T) {
	m := &Stats{Devices: []DeviceStats{{Ordinal: 0, Regions: 1, UUID: [16]byte{9}}}, Daemon: &DaemonStats{Policy: "lru"}, Spares: &SpareStats{Reused: 1}}
	b := m.AppendBody(nil)
	b = b[:len(b)-(4+8)-8-(4+16)] // without the section (and the made-ahead and device-faults ones after it)
	got, err := Decode(TypeStats|TypeReply, b)
	if err != nil {
		t.Fatal(err)
	}
	st := got.(*Stats)
	if len(st.Devices) != 1 || st.Devices[0].Regions != 1 || st.Devices[0].UUID != [16]byte{} || st.Spares == nil || st.Spares.Reused != 1 {
		t.Fatalf("decoded %+v, want the device with no UUID and the spares section", st)
	}
}

// TestStatsOfADaemonBeforeSparesMadeAheadSaysNone: a reply that ends
// after the device-identity section (a daemon that predates spares made
// ahead, and device faults) decodes, with none made.
func TestStatsOfADaemonBeforeSparesMadeAheadSaysNone(t *testing.T) {
	m := &Stats{Devices: []DeviceStats{{Ordinal: 0, UUID: [16]byte{9}}}, Daemon: &DaemonStats{Policy: "lru"}, Spares: &SpareStats{Reused: 1, Made: 7}}
	b := m.AppendBody(nil)
	got, err := Decode(TypeStats|TypeReply, b[:len(b)-(4+8)-8]) // without it and the device-faults section after it
	if err != nil {
		t.Fatal(err)
	}
	st := got.(*Stats)
	if st.Spares == nil || st.Spares.Made != 0 || st.Spares.Reused != 1 || st.Devices[0].UUID != [16]byte{9} {
		t.Fatalf("decoded %+v (spares %+v), want the device's UUID, 1 reused and none made", st, st.Spares)
	}
	full, err := Decode(TypeStats|TypeReply, b)
	if err != nil || full.(*Stats).Spares.Made != 7 {
		t.Fatalf("the whole reply: %v, %+v; want 7 made", err, full)
	}
}

// TestStatsOfADaemonBeforeDeviceFaultsSaysNone: a reply that ends after
// the made-ahead count (a daemon that predates the device-faults section)
// decodes, with no faults on any device; the whole reply carries them.
func TestStatsOfADaemonBeforeDeviceFaultsSaysNone(t *testing.T) {
	m := &Stats{Devices: []DeviceStats{{Ordinal: 0, Faults: 2}, {Ordinal: 1, UUID: [16]byte{9}}}, Daemon: &DaemonStats{Policy: "lru"}, Spares: &SpareStats{Made: 7}}
	b := m.AppendBody(nil)
	got, err := Decode(TypeStats|TypeReply, b[:len(b)-4-2*8])
	if err != nil {
		t.Fatal(err)
	}
	st := got.(*Stats)
	if st.Devices[0].Faults != 0 || st.Devices[1].UUID != [16]byte{9} || st.Spares.Made != 7 {
		t.Fatalf("decoded %+v (spares %+v), want no faults, device 1's UUID and 7 made", st, st.Spares)
	}
	full, err := Decode(TypeStats|TypeReply, b)
	if err != nil {
		t.Fatal(err)
	}
	if d := full.(*Stats).Devices; d[0].Faults != 2 || d[1].Faults != 0 {
		t.Fatalf("the whole reply: devices %+v; want 2 faults on device 0, none on 1", d)
	}
}

func TestParseHeader(t *testing.T) {
	f := AppendFrame(nil, 1, &Cancel{Job: 1})
	if _, err := ParseHeader(f, len(f)-1); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("oversized frame: %v", err)
	}
	f[6] = 1
	if _, err := ParseHeader(f, 1<<20); !errors.Is(err, ErrMalformed) {
		t.Fatalf("flags: %v", err)
	}
	if _, err := ParseHeader(f[:10], 1<<20); !errors.Is(err, ErrMalformed) {
		t.Fatalf("short: %v", err)
	}
}

// fuzzSeeds are FuzzDecode's seed frames: the sample messages of every
// file, of one id.
func fuzzSeeds() [][]byte {
	var seeds [][]byte
	for _, m := range slices.Concat(sampleMessages(), pinMessages(), tableMessages(), purgeMessages(), layerMessages(), removalMessages(), budgetMessages()) {
		seeds = append(seeds, AppendFrame(nil, 1, m))
	}
	return seeds
}

// TestFuzzDecodeSeedsEveryType: FuzzDecode starts from a valid frame of
// every type New knows, so that each decoder is fuzzed from a body it
// accepts rather than only when a mutation happens on its type.
func TestFuzzDecodeSeedsEveryType(t *testing.T) {
	seeded := map[Type]bool{}
	for _, f := range fuzzSeeds() {
		h, err := ParseHeader(f, MaxFrame)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Decode(h.Type, f[HeaderSize:]); err != nil {
			t.Fatalf("seed of %s: %v", h.Type, err)
		}
		seeded[h.Type] = true
	}
	var missing []string
	for ty := range 1 << 16 {
		if _, err := New(Type(ty)); err == nil && !seeded[Type(ty)] {
			missing = append(missing, Type(ty).String())
		}
	}
	if len(missing) > 0 {
		t.Fatalf("no seed of %d types: %v", len(missing), missing)
	}
}

// FuzzDecode feeds arbitrary frames to the decoders: they must not panic,
// and whatever decodes must re-encode to a body that decodes to the same
// message.
func FuzzDecode(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, frame []byte) {
		h, err := ParseHeader(frame, 1<<20)
		if err != nil {
			return
		}
		body := frame[HeaderSize:]
		if int(h.Len) < len(body) {
			body = body[:h.Len]
		}
		m, err := Decode(h.Type, body)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnknownType) {
				t.Fatalf("error %v wraps no sentinel", err)
			}
			return
		}
		again, err := Decode(h.Type, m.AppendBody(nil))
		if err != nil {
			t.Fatalf("re-encoded %T does not decode: %v", m, err)
		}
		if !reflect.DeepEqual(m, again) {
			t.Fatalf("round trip changed %#v into %#v", m, again)
		}
	})
}

var update = flag.Bool("update", false, "rewrite the golden files of other languages' tests")

// goldenStats is the Stats reply client/python/tests/testdata/stats.bin
// holds: the Python client's decoder is tested against these bytes, so
// that both sides of the wire read the same layout.
func goldenStats() *Stats {
	return &Stats{Entries: 1, Keys: 2, Clients: 3, InflightJobs: 4,
		Mounts:  []MountStats{{Capacity: 10, Used: 5, Entries: 1, Direct: true}},
		Devices: []DeviceStats{{Ordinal: 0, Regions: 1, Registered: 4096, Limit: 1 << 30, UUID: [16]byte{0: 0xA, 15: 0xA}}, {Ordinal: 1, Limit: 1 << 30, Faults: 3}},
		Daemon: &DaemonStats{Started: 1, Policy: "lru", PolicyBackend: "wasm", FallbackReason: "none", LastReload: "ok",
			Mounts:  []MountInfo{{Path: "/dev/shm/kv", Backend: "staging", IO: "direct", Checksums: true, Configured: 1 << 30, Class: "memory"}},
			Budgets: []BudgetStats{{Model: "vllm:m:*", Used: 16, Budget: 17, Floor: 18, Over: 19, Kept: 20}}},
		Spares:        &SpareStats{Reused: 3, Mounts: []SpareMount{{Files: 2, Bytes: 1 << 21}}, Made: 5},
		Tiering:       &TierStats{Demotions: 1, Promotions: 2, Moves: 3, MoveFailures: 4, DemotionDeletes: 5, Mounts: []TierMount{{MovedIn: 6, MovedOut: 7}}, FallbackPolicy: "lru"},
		StoresFailing: []MountFailure{{Since: 8, Last: 9, Stores: 10, Err: "read-only file system"}},
		Namespaces:    &NamespaceList{List: []NamespaceStats{{Fingerprint: 11, Model: "vllm:m:0", Declared: true, Files: 12, Keys: 13, Bytes: 14, Caches: 15}}}}
}

// TestStatsGoldenBytesForThePythonClient: the encoding of goldenStats is
// the file the Python client's test decodes (go test ./protocol -update
// rewrites it).
func TestStatsGoldenBytesForThePythonClient(t *testing.T) {
	path := filepath.Join("..", "client", "python", "tests", "testdata", "stats.bin")
	got := goldenStats().AppendBody(nil)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./protocol -update writes it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from the encoding of goldenStats: run go test ./protocol -update, and check the Python client's decoder", path)
	}
}

// TestHelloWireBytes: the Hello body is the bytes the Python client
// (protocol.py MAGIC) and every released daemon write: "KVHOST", 0, 1,
// u16 version, u16 0, str8 client.
func TestHelloWireBytes(t *testing.T) {
	got := (&Hello{Version: 1, Client: "c"}).AppendBody(nil)
	want := []byte{'K', 'V', 'H', 'O', 'S', 'T', 0, 1, 1, 0, 0, 0, 1, 'c'}
	if !bytes.Equal(got, want) {
		t.Fatalf("Hello body % x, want % x", got, want)
	}
}

// TestTransferCheckNoBlock: NoBlock passes in a load that names another
// block of every key; a store carrying it, and a load key of NoBlocks
// only, are refused naming the key.
func TestTransferCheckNoBlock(t *testing.T) {
	for _, tc := range []struct {
		name   string
		kind   JobKind
		blocks [][]uint32
		want   string // "" for nil
	}{
		{"load without NoBlock", JobLoad, [][]uint32{{1, 2}, {3, 4}}, ""},
		{"load starting inside a key", JobLoad, [][]uint32{{NoBlock, 2}, {3, 4}}, ""},
		{"load ending inside a key", JobLoad, [][]uint32{{1, 2}, {3, NoBlock}}, ""},
		{"load of one block inside a key", JobLoad, [][]uint32{{NoBlock, 5, NoBlock}}, ""},
		{"load of a key of NoBlocks only", JobLoad, [][]uint32{{1, 2}, {NoBlock, NoBlock}}, "key 1: every block id is 0xffffffff (NoBlock)"},
		{"store without NoBlock", JobStore, [][]uint32{{1, 2}}, ""},
		{"store with NoBlock", JobStore, [][]uint32{{1, 2}, {NoBlock, 4}}, "key 1: block id 0xffffffff (NoBlock) in a store"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Transfer{Kind: tc.kind, Cache: 1, Blocks: tc.blocks}
			for range tc.blocks {
				m.Keys = append(m.Keys, []byte("k"))
			}
			err := m.CheckNoBlock()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("CheckNoBlock() = %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("CheckNoBlock() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
