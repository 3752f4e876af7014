package clustercap

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
)

func TestSketchBelowIsExactAtPointsAndNeverDecreases(t *testing.T) {
	var items []Item
	for r := uint64(1); r <= 1000; r++ {
		items = append(items, Item{Rank: r * 10, Bytes: 4})
	}
	s := NewSketch(items, 16)
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	if s.Total() != 4000 || len(s.Ranks) > 18 {
		t.Fatalf("total %d in %d points: want 4000 in at most 18", s.Total(), len(s.Ranks))
	}
	for i, r := range s.Ranks {
		if got := s.Below(r + 1); got != s.Bytes[i] {
			t.Fatalf("Below(%d) = %d, want %d (point %d)", r+1, got, s.Bytes[i], i)
		}
	}
	prev := int64(0)
	for r := uint64(0); r <= 10010; r += 7 {
		got := s.Below(r)
		exact := int64(0)
		if r > 10 {
			exact = int64(min((r-1)/10, 1000)) * 4
		}
		if got < prev || got-exact > 4000/16+4 || exact-got > 4000/16+4 {
			t.Fatalf("Below(%d) = %d after %d: want non-decreasing, within one point's bytes of %d", r, got, prev, exact)
		}
		prev = got
	}
}

func TestCutoffCoversTheExcessAcrossNodes(t *testing.T) {
	// Node a's files are old (ranks 0..99), b's recent (100..199): a
	// cut-off for 150 bytes takes every byte of a and half of b.
	var a, b []Item
	for r := range uint64(100) {
		a = append(a, Item{Rank: r, Bytes: 1})
		b = append(b, Item{Rank: 100 + r, Bytes: 1})
	}
	sa, sb := NewSketch(a, 200), NewSketch(b, 200)
	tests := []struct {
		excess int64
		want   uint64
		ok     bool
	}{
		{0, 0, true},
		{50, 50, true},
		{150, 150, true},
		{200, 200, true},
		{201, 200, false},
	}
	for _, tc := range tests {
		got, ok := Cutoff([]Sketch{sa, sb}, tc.excess)
		if got != tc.want || ok != tc.ok {
			t.Errorf("Cutoff(excess %d) = %d, %v; want %d, %v", tc.excess, got, ok, tc.want, tc.ok)
		}
	}
}

func TestDecideCutsOnlyAboveTheHighWatermarkAndFollowsAPeersRecentCut(t *testing.T) {
	b, err := NewBound(1000, 0.9, 0.8)
	if err != nil {
		t.Fatal(err)
	}
	items := func(lo, n uint64) Sketch {
		var it []Item
		for r := lo; r < lo+n; r++ {
			it = append(it, Item{Rank: r, Bytes: 1})
		}
		return NewSketch(it, SketchPoints)
	}
	peer := func(lo, n uint64, cut uint64, cutTime int64) *Summary {
		return &Summary{Version: SummaryVersion, Node: "p", Tag: Tag("p"), Time: 100, Interval: 10, Bytes: int64(n), Claim: int64(n), Sketch: items(lo, n), Cut: cut, CutTime: cutTime}
	}
	tests := []struct {
		name     string
		own      uint64 // own files: ranks 1000..1000+own
		peer     *Summary
		want     uint64
		computed bool
	}{
		{"below high", 400, peer(0, 400, 0, 0), 0, false},
		{"above high: the old peer's files go first", 500, peer(0, 450, 0, 0), 150, true},
		{"a peer's recent cut", 400, peer(0, 400, 77, 95), 77, false},
		{"a peer's old cut is ignored", 400, peer(0, 400, 77, 50), 0, false},
	}
	for _, tc := range tests {
		p := b.Decide(100, items(1000, tc.own), int64(tc.own), []*Summary{tc.peer}, 20)
		if p.Cut != tc.want || p.Computed != tc.computed {
			t.Errorf("%s: cut %d computed %v, want %d %v", tc.name, p.Cut, p.Computed, tc.want, tc.computed)
		}
	}
}

// TestDecideJudgesAPeersCutAgeOnThePeersClock: a peer's cut is in force
// while its summary's time is within the window of the cut's time, both
// on the peer's clock, however far that clock is from this node's.
func TestDecideJudgesAPeersCutAgeOnThePeersClock(t *testing.T) {
	const iv = int64(1e9)
	now := int64(1_800_000_000) * iv
	b := Bound{Capacity: 1000, High: 900, Low: 800}
	for _, tc := range []struct {
		name     string
		skew     int64 // the peer's clock minus this node's
		cutAge   int64 // the cut's age at the peer's summary, on its clock
		wantsCut bool
	}{
		{"clock an hour ahead, cut 10 intervals old", 3600 * iv, 10 * iv, false},
		{"clock an hour ahead, cut 1 interval old", 3600 * iv, iv, true},
		{"clock an hour behind, cut 10 intervals old", -3600 * iv, 10 * iv, false},
		{"clock an hour behind, cut 1 interval old", -3600 * iv, iv, true},
	} {
		p := &Summary{Version: SummaryVersion, Node: "a", Tag: Tag("a"), Time: now + tc.skew, Interval: iv, Bytes: 10, Claim: 10,
			Cut: 12345, CutTime: now + tc.skew - tc.cutAge, Sketch: Sketch{Ranks: []uint64{1}, Bytes: []int64{10}}}
		pl := b.Decide(now, Sketch{}, 0, []*Summary{p}, 2*iv)
		if got := pl.Cut == 12345; got != tc.wantsCut {
			t.Errorf("%s: cut %d, want the peer's cut in force: %v", tc.name, pl.Cut, tc.wantsCut)
		}
	}
}

func TestFileIDCarriesItsOwnersTag(t *testing.T) {
	for _, node := range []string{"node-1", "node-2", "a", "x.y_z"} {
		tag := Tag(node)
		for _, r := range []uint64{0, 1, ^uint64(0), 0x123456789abcdef} {
			id := FileID(tag, r)
			got, ok := Owner(id)
			if id == 0 || !ok || got != tag {
				t.Fatalf("FileID(Tag(%q), %#x) = %#x: owner %#x %v, want %#x", node, r, id, got, ok, tag)
			}
		}
	}
	if _, ok := Owner(0); ok {
		t.Fatal("Owner(0) reports an owner: want none (a file written before ids)")
	}
}

func TestSummaryRoundTripsAndBadOnesAreNamed(t *testing.T) {
	good := Summary{Version: SummaryVersion, Node: "n1", Tag: Tag("n1"), Seq: 3, Time: 5, Interval: 1e9, Bytes: 10, Claim: 20,
		Sketch: NewSketch([]Item{{1, 4}, {2, 6}}, 8), Touches: []Touch{{ID: 7, Rank: 9}}}
	b, err := Encode(&good)
	if err != nil {
		t.Fatal(err)
	}
	back, err := Decode(b)
	if err != nil || back.Claim != 20 || back.Sketch.Total() != 10 || len(back.Touches) != 1 {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	tests := []struct {
		name string
		edit func(s *Summary)
	}{
		{"version", func(s *Summary) { s.Version = SummaryVersion + 1 }},
		{"capacity beyond MaxBytes", func(s *Summary) { s.Capacity = MaxBytes + 1 }},
		{"negative bound", func(s *Summary) { s.Bound = -1 }},
		{"negative untagged bytes", func(s *Summary) { s.Untagged = -1 }},
		{"policy name too long", func(s *Summary) { s.Policy = strings.Repeat("p", MaxPolicyName+1) }},
		{"version 0", func(s *Summary) { s.Version = 0 }},
		{"tag", func(s *Summary) { s.Tag++ }},
		{"claim below bytes", func(s *Summary) { s.Claim = 5 }},
		{"interval", func(s *Summary) { s.Interval = 0 }},
		{"sketch", func(s *Summary) { s.Sketch.Bytes = s.Sketch.Bytes[:1] }},
		{"claim beyond MaxBytes", func(s *Summary) { s.Claim = MaxBytes + 1 }},
		{"bytes beyond MaxBytes", func(s *Summary) { s.Bytes, s.Claim = MaxBytes+1, MaxBytes+1 }},
		{"sketch beyond MaxBytes", func(s *Summary) { s.Sketch = Sketch{Ranks: []uint64{1}, Bytes: []int64{MaxBytes + 1}} }},
		{"adopting itself", func(s *Summary) { s.Adopted = []string{"n1"} }},
		{"adopting a bad name", func(s *Summary) { s.Adopted = []string{"a/b"} }},
		{"adopting too many", func(s *Summary) { s.Adopted = make([]string, MaxAdopted+1) }},
		{"sharing flocks with itself", func(s *Summary) { s.LockShared = []string{"n1"} }},
		{"sharing flocks with a bad name", func(s *Summary) { s.LockShared = []string{".x"} }},
		{"sharing flocks with too many", func(s *Summary) { s.LockShared = make([]string, MaxAdopted+1) }},
		{"sketch of too many points", func(s *Summary) {
			s.Sketch = Sketch{}
			for i := range MaxSketchPoints + 1 {
				s.Sketch.Ranks = append(s.Sketch.Ranks, uint64(i))
				s.Sketch.Bytes = append(s.Sketch.Bytes, int64(i+1))
			}
		}},
	}
	for _, tc := range tests {
		s := good
		s.Sketch = Sketch{Ranks: append([]uint64(nil), good.Sketch.Ranks...), Bytes: append([]int64(nil), good.Sketch.Bytes...)}
		tc.edit(&s)
		if _, err := Encode(&s); !errors.Is(err, ErrSummary) {
			t.Errorf("%s: Encode error %v, want ErrSummary", tc.name, err)
		}
	}
	if _, err := Decode([]byte("{")); !errors.Is(err, ErrSummary) {
		t.Errorf("truncated: Decode error %v, want ErrSummary", err)
	}
}

// TestSummaryOfALaterVersionIsReadForTheFieldsThisOneKnows: a summary of
// a later format version (a node of a newer kvhost, a rolling upgrade)
// decodes, its unknown fields ignored, its claim and bytes read; one of
// an earlier version (0) or one whose known fields are bad does not.
func TestSummaryOfALaterVersionIsReadForTheFieldsThisOneKnows(t *testing.T) {
	newer := fmt.Sprintf(`{"version":%d,"node":"n","tag":%d,"seq":4,"time":5,"interval":10,"bytes":30,"claim":40,"sketch":{"ranks":[1],"bytes":[30]},"future_field":{"x":[1,2]}}`,
		SummaryVersion+1, Tag("n"))
	s, err := Decode([]byte(newer))
	if err != nil || s.Claim != 40 || s.Bytes != 30 || s.Version != SummaryVersion+1 {
		t.Fatalf("a summary of version %d: %+v, %v; want it read, claim 40", SummaryVersion+1, s, err)
	}
	for _, bad := range []string{
		strings.Replace(newer, fmt.Sprintf(`"version":%d`, SummaryVersion+1), `"version":0`, 1),
		strings.Replace(newer, `"claim":40`, `"claim":20`, 1), // below its bytes
	} {
		if _, err := Decode([]byte(bad)); !errors.Is(err, ErrSummary) {
			t.Errorf("Decode(%s) error %v, want ErrSummary", bad, err)
		}
	}
}

// TestClaimsOfPeersNeverWrapSoFitsRefusesPastTheCapacity: a claim of
// MaxInt64 does not decode, and peers claiming the most a summary may
// state, summed, still leave no room under a bound of 1 GiB.
func TestClaimsOfPeersNeverWrapSoFitsRefusesPastTheCapacity(t *testing.T) {
	huge := &Summary{Version: SummaryVersion, Node: "x", Tag: Tag("x"), Time: 1, Interval: 1, Claim: math.MaxInt64}
	b, err := json.Marshal(huge)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Decode(b); !errors.Is(err, ErrSummary) {
		t.Fatalf("a claim of MaxInt64 bytes decodes (%v): want ErrSummary", err)
	}
	bound := Bound{Capacity: 1 << 30, High: 1 << 29, Low: 1 << 28}
	var peers []*Summary
	for range 4 {
		peers = append(peers, &Summary{Claim: MaxBytes, Bytes: MaxBytes})
	}
	if bound.Fits(1<<20, peers) {
		t.Fatalf("peers claiming %d bytes each leave room for 1 MiB more under a bound of 1 GiB (the sum wrapped)", int64(MaxBytes))
	}
	if got := Claims(peers); got != math.MaxInt64 {
		t.Fatalf("Claims of 4 peers at MaxBytes = %d, want MaxInt64 (saturated)", got)
	}
	if p := bound.Decide(1, Sketch{}, 1, peers, 1); p.Total != math.MaxInt64 {
		t.Fatalf("Decide's total of 4 peers at MaxBytes = %d, want MaxInt64 (saturated)", p.Total)
	}
}

// TestUnclaimedCountsADeadNodeUntilALiveNodeNamesItAdopted: a dead
// node's last summary counts (its claim, no cut-off in force) until a
// live node's summary names it adopted, or the caller has covered it; a
// dead node's summary naming it covers nothing.
func TestUnclaimedCountsADeadNodeUntilALiveNodeNamesItAdopted(t *testing.T) {
	d := &Summary{Node: "d", Claim: 40, Bytes: 30, Cut: 9, CutTime: 1, Touches: []Touch{{ID: 1}}}
	tests := []struct {
		name    string
		dead    []*Summary
		live    []*Summary
		covered func(string) bool
		want    int64 // Claims of the result
	}{
		{"no adopter", []*Summary{d}, []*Summary{{Node: "a", Claim: 5}}, nil, 40},
		{"a live adopter names it", []*Summary{d}, []*Summary{{Node: "a", Claim: 5, Adopted: []string{"d"}}}, nil, 0},
		{"a dead adopter names it", []*Summary{d, {Node: "a", Claim: 5, Adopted: []string{"d"}}}, nil, nil, 45},
		{"covered by the caller", []*Summary{d}, nil, func(n string) bool { return n == "d" }, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := Unclaimed(tc.dead, tc.live, tc.covered)
			if c := Claims(got); c != tc.want {
				t.Fatalf("the unclaimed dead nodes claim %d bytes, want %d", c, tc.want)
			}
			for _, g := range got {
				if g.Cut != 0 || len(g.Touches) != 0 || len(g.Adopted) != 0 {
					t.Fatalf("dead node %s's cut-off, touches or adoptions still count: %+v", g.Node, g)
				}
			}
		})
	}
	if d.Cut != 9 || len(d.Touches) != 1 {
		t.Fatalf("Unclaimed changed the summary it was given: %+v", d)
	}
}

func TestDirPublishesReadsAndTellsALiveNodeFromADeadOne(t *testing.T) {
	root := t.TempDir()
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, err := OpenDir(fsys.OS{}, root, "a"); !errors.Is(err, ErrNodeLocked) {
		t.Fatalf("second OpenDir of node a: %v, want ErrNodeLocked", err)
	}
	b, err := OpenDir(fsys.OS{}, root, "b")
	if err != nil {
		t.Fatal(err)
	}
	sum := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	if err := b.Publish(sum); err != nil {
		t.Fatal(err)
	}
	got, bad, err := a.ReadAll()
	if err != nil || len(bad) != 0 || len(got) != 1 || got[0].Node != "b" || got[0].Claim != 4 {
		t.Fatalf("ReadAll: %v %v %v, want b's summary", got, bad, err)
	}
	// Stale but locked: live. Stale and unlocked: dead.
	live, err := Live(got[0], 1000, a.LockFree)
	if err != nil || !live {
		t.Fatalf("stale summary of a running node: live %v (%v), want live", live, err)
	}
	b.Close()
	live, err = Live(got[0], 1000, a.LockFree)
	if err != nil || live {
		t.Fatalf("stale summary of a closed node: live %v (%v), want dead", live, err)
	}
	if live, _ := Live(got[0], 20, a.LockFree); !live {
		t.Fatal("a fresh summary of a closed node: dead, want live until it is stale")
	}
}

// TestOpenDirWaitsOutAnotherNodesProbeOfItsLock: node a probes dead node
// d's lock (LockFree takes it a moment) while d starts again; d's OpenDir
// waits for the probe to let go instead of failing with ErrNodeLocked.
func TestOpenDirWaitsOutAnotherNodesProbeOfItsLock(t *testing.T) {
	root := t.TempDir()
	d, err := OpenDir(fsys.OS{}, root, "d")
	if err != nil {
		t.Fatal(err)
	}
	d.Close() // d dies
	inProbe, release := make(chan struct{}), make(chan struct{})
	slowClose := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpClose && strings.HasSuffix(path, "/d.lock") {
			close(inProbe)
			<-release // the probe's close on a shared mount: a round trip
		}
		return fsys.Fault{}
	})
	a, err := OpenDir(&fsys.Faulty{FS: fsys.OS{}, Inj: slowClose}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if free, err := a.LockFree("d"); !free || err != nil {
			t.Errorf("probe: free %v, %v", free, err)
		}
	}()
	<-inProbe
	var tries atomic.Int32
	letGo := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpLock && tries.Add(1) == 2 {
			close(release) // the probe ends after d's first try
		}
		return fsys.Fault{}
	})
	d2, err := OpenDir(&fsys.Faulty{FS: fsys.OS{}, Inj: letGo}, root, "d")
	if tries.Load() < 2 {
		close(release)
	}
	<-done
	if err != nil {
		t.Fatalf("node d starting again while node a probes its lock: %v", err)
	}
	d2.Close()
}

// TestReadAllRetriesAStaleFileHandle: an ESTALE from the directory's
// listing or a summary's open or read (a shared mount whose file was
// replaced under a cached handle) is retried, not reported.
func TestReadAllRetriesAStaleFileHandle(t *testing.T) {
	sum := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	for _, op := range []fsys.Op{fsys.OpReadDir, fsys.OpOpen, fsys.OpRead} {
		t.Run(op.String(), func(t *testing.T) {
			root := t.TempDir()
			if err := openAndPublish(fsys.OS{}, root, sum); err != nil {
				t.Fatal(err)
			}
			a, err := OpenDir(fsys.OS{}, root, "a")
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			// a publishes first, as the engine does before it reads: the
			// listing needs no touch, so the open that fails is the summary's.
			own := *sum
			own.Node, own.Tag = "a", Tag("a")
			if err := a.Publish(&own); err != nil {
				t.Fatal(err)
			}
			a.fs = &fsys.Faulty{FS: fsys.OS{}, Inj: &fsys.Counter{Ops: []fsys.Op{op}, Fault: fsys.Fault{Err: syscall.ESTALE}}}
			got, bad, err := a.ReadAll()
			if err != nil || len(bad) != 0 || len(got) != 1 || got[0].Node != "b" {
				t.Fatalf("ReadAll with one ESTALE on %s: %v %v %v, want b's summary", op, got, bad, err)
			}
		})
	}
}

// TestReadAllReadsPastASummaryThatKeepsFailing: a summary file whose
// every open fails is reported by its node's name beside the others, not
// as a failed read; the last summary of it that was read stands in for
// it, and with none read before it is left out.
func TestReadAllReadsPastASummaryThatKeepsFailing(t *testing.T) {
	root := t.TempDir()
	for _, n := range []string{"b", "c"} {
		s := &Summary{Version: SummaryVersion, Node: n, Tag: Tag(n), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
		if err := openAndPublish(fsys.OS{}, root, s); err != nil {
			t.Fatal(err)
		}
	}
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if got, bad, err := a.ReadAll(); err != nil || len(bad) != 0 || len(got) != 2 {
		t.Fatalf("first ReadAll: %v %v %v, want b's and c's summaries", got, bad, err)
	}
	b2 := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 2, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	if err := openAndPublish(fsys.OS{}, root, b2); err != nil {
		t.Fatal(err)
	}
	eio := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpOpen && strings.HasSuffix(path, "/c"+summarySuffix) {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})}
	fresh, err := OpenDir(fsys.OS{}, root, "f") // has read none of them
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	for _, tc := range []struct {
		name  string
		d     *Dir
		wantC bool // c's last summary stands in for it
	}{
		{"c read before", a, true},
		{"c never read", fresh, false},
	} {
		tc.d.fs = eio
		got, bad, err := tc.d.ReadAll()
		if err != nil {
			t.Fatalf("%s: ReadAll with c's summary failing: %v, want the others", tc.name, err)
		}
		var se *SummaryError
		if len(bad) != 1 || !errors.As(bad[0], &se) || se.Node != "c" || !errors.Is(bad[0], syscall.EIO) {
			t.Fatalf("%s: errors %v, want c's EIO as a *SummaryError", tc.name, bad)
		}
		byNode := map[string]*Summary{}
		for _, s := range got {
			byNode[s.Node] = s
		}
		if byNode["b"] == nil || byNode["b"].Time != 2 {
			t.Fatalf("%s: b's summary %+v, want its second", tc.name, byNode["b"])
		}
		if c := byNode["c"]; (c != nil) != tc.wantC || len(got) != len(byNode) {
			t.Fatalf("%s: summaries %v, want c's last one: %v", tc.name, got, tc.wantC)
		}
	}
}

// TestReadAllNamesTheNodeOfASummaryThatDoesNotDecode: a truncated summary
// is reported as a *SummaryError naming its node, wrapping ErrSummary and
// giving the file's modification time, so that a caller can find the node
// dead by its lock.
func TestReadAllNamesTheNodeOfASummaryThatDoesNotDecode(t *testing.T) {
	root := t.TempDir()
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := os.WriteFile(filepath.Join(a.Path(), "x"+summarySuffix), []byte(`{"version":1,`), 0o644); err != nil {
		t.Fatal(err)
	}
	got, bad, err := a.ReadAll()
	var se *SummaryError
	if err != nil || len(got) != 0 || len(bad) != 1 || !errors.As(bad[0], &se) || se.Node != "x" || !errors.Is(se, ErrSummary) || se.ModTime.IsZero() {
		t.Fatalf("ReadAll of a truncated summary: %v %v %v, want a *SummaryError of node x with ErrSummary and its time", got, bad, err)
	}
}

// TestReadAllSeesANodeThatJoinedSinceTheClientsLastListing: node b
// publishes its first summary after node a's NFS client listed the
// directory; a's next ReadAll must find it whether or not a changed the
// directory since (a publication renames into it), and after a restart
// of a on the same client.
func TestReadAllSeesANodeThatJoinedSinceTheClientsLastListing(t *testing.T) {
	sum := func(node string) *Summary {
		return &Summary{Version: SummaryVersion, Node: node, Tag: Tag(node), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	}
	for _, tc := range []struct {
		name  string
		after func(t *testing.T, a *Dir, root string, client fsys.FS) *Dir // after b joined: the Dir that reads
	}{
		{"nothing written since", func(t *testing.T, a *Dir, _ string, _ fsys.FS) *Dir { return a }},
		{"published since", func(t *testing.T, a *Dir, _ string, _ fsys.FS) *Dir {
			if err := a.Publish(sum("a")); err != nil {
				t.Fatal(err)
			}
			return a
		}},
		{"restarted on the same client", func(t *testing.T, a *Dir, root string, client fsys.FS) *Dir {
			a.Close()
			a2, err := OpenDir(client, root, "a")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { a2.Close() })
			return a2
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			client := fsystest.NewListingCache(fsys.OS{}) // an NFS client, say, mounted nocto
			a, err := OpenDir(client, root, "a")
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			if got, _, err := a.ReadAll(); err != nil || len(got) != 0 {
				t.Fatalf("first ReadAll: %v, %v; want no summaries", got, err)
			}
			b, err := OpenDir(fsys.OS{}, root, "b") // through another client
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if err := b.Publish(sum("b")); err != nil {
				t.Fatal(err)
			}
			got, bad, err := tc.after(t, a, root, client).ReadAll()
			if err != nil || len(bad) != 0 || len(got) != 1 || got[0].Node != "b" {
				t.Fatalf("ReadAll after node b joined: %v %v %v, want b's summary", got, bad, err)
			}
		})
	}
}

// TestAdoptionLockIsHeldByOneNodeAtATime: once node x's lock is free, one
// of two live nodes takes its adoption lock, the other is refused until
// the first releases it (or closes); the holder is told it holds it again.
func TestAdoptionLockIsHeldByOneNodeAtATime(t *testing.T) {
	root := t.TempDir()
	x, err := OpenDir(fsys.OS{}, root, "x")
	if err != nil {
		t.Fatal(err)
	}
	x.Close() // x dies: its lock is free
	y, err := OpenDir(fsys.OS{}, root, "y")
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	z, err := OpenDir(fsys.OS{}, root, "z")
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	steps := []struct {
		name string
		d    *Dir
		op   func(d *Dir) (bool, error)
		want bool
	}{
		{"y adopts x", y, func(d *Dir) (bool, error) { return d.Adopt("x") }, true},
		{"y adopts x again", y, func(d *Dir) (bool, error) { return d.Adopt("x") }, true},
		{"z is refused while y holds it", z, func(d *Dir) (bool, error) { return d.Adopt("x") }, false},
		{"y releases", y, func(d *Dir) (bool, error) { return true, d.Release("x") }, true},
		{"z adopts x", z, func(d *Dir) (bool, error) { return d.Adopt("x") }, true},
		{"y is refused", y, func(d *Dir) (bool, error) { return d.Adopt("x") }, false},
		{"z closes", z, func(d *Dir) (bool, error) { return true, d.Close() }, true},
		{"y adopts x after z closed", y, func(d *Dir) (bool, error) { return d.Adopt("x") }, true},
	}
	for _, s := range steps {
		got, err := s.op(s.d)
		if err != nil || got != s.want {
			t.Fatalf("%s: %v, %v; want %v", s.name, got, err, s.want)
		}
	}
	if got := y.Adopted(); len(got) != 1 || got[0] != "x" {
		t.Fatalf("y holds the adoption of %v, want [x]", got)
	}
	if _, err := y.Adopt("../x"); err == nil {
		t.Fatal("a node name with '/' was accepted")
	}
}

// TestRetireRemovesADeadNodesFilesAndLetsItStartAgain: the adopter of a
// dead node retires it: its summary, lock, adoption file and summary
// temporaries go and the adoption is released; the node then starts and
// publishes afresh. A node not adopted, or running again, is not retired.
func TestRetireRemovesADeadNodesFilesAndLetsItStartAgain(t *testing.T) {
	root := t.TempDir()
	sum := &Summary{Version: SummaryVersion, Node: "x", Tag: Tag("x"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	if err := openAndPublish(fsys.OS{}, root, sum); err != nil { // x runs, then dies
		t.Fatal(err)
	}
	y, err := OpenDir(fsys.OS{}, root, "y")
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	tmp := filepath.Join(y.Path(), ".x.tmp-0123456789abcdef") // x died publishing
	if err := os.WriteFile(tmp, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if ok, err := y.Retire("x"); ok || err == nil {
		t.Fatalf("Retire of a node not adopted: %v, %v; want an error", ok, err)
	}
	if ok, err := y.Adopt("x"); !ok || err != nil {
		t.Fatalf("Adopt: %v, %v", ok, err)
	}
	x, err := OpenDir(fsys.OS{}, root, "x") // x runs again
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := y.Retire("x"); ok || err != nil {
		t.Fatalf("Retire of a node running again: %v, %v; want false", ok, err)
	}
	x.Close()
	if ok, err := y.Retire("x"); !ok || err != nil {
		t.Fatalf("Retire: %v, %v; want true", ok, err)
	}
	ents, err := os.ReadDir(y.Path())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.Contains(e.Name(), "x") {
			t.Errorf("%s left behind", e.Name())
		}
	}
	if got := y.Adopted(); len(got) != 0 {
		t.Errorf("adoptions held after Retire: %v, want none", got)
	}
	if err := openAndPublish(fsys.OS{}, root, sum); err != nil {
		t.Fatalf("x starting again after Retire: %v", err)
	}
}

// TestLocksHoldTheFileThatRetireLeaves: a node that opened a lock file
// another node's Retire removes before it locks it (x's own lock, z's
// adoption of x) locks the file at that path afterwards, not the removed
// one: so x is seen running and z's adoption excludes w's.
func TestLocksHoldTheFileThatRetireLeaves(t *testing.T) {
	for _, tc := range []struct {
		name string
		lock func(t *testing.T, root string, fs fsys.FS) (check func() error, err error) // runs the Retire within it
	}{
		{"x's own lock", func(t *testing.T, root string, fs fsys.FS) (func() error, error) {
			x, err := OpenDir(fs, root, "x")
			if err != nil {
				return nil, err
			}
			t.Cleanup(func() { x.Close() })
			return func() error {
				w, err := OpenDir(fsys.OS{}, root, "w")
				if err != nil {
					return err
				}
				defer w.Close()
				if free, err := w.LockFree("x"); free || err != nil {
					return fmt.Errorf("x's lock free %v (%v) while x runs", free, err)
				}
				return nil
			}, nil
		}},
		{"z's adoption", func(t *testing.T, root string, fs fsys.FS) (func() error, error) {
			z, err := OpenDir(fsys.OS{}, root, "z")
			if err != nil {
				return nil, err
			}
			t.Cleanup(func() { z.Close() })
			z.fs = fs
			if ok, err := z.Adopt("x"); !ok || err != nil {
				return nil, fmt.Errorf("z adopts x: %v, %w", ok, err)
			}
			return func() error {
				w, err := OpenDir(fsys.OS{}, root, "w")
				if err != nil {
					return err
				}
				defer w.Close()
				if ok, err := w.Adopt("x"); ok || err != nil {
					return fmt.Errorf("w adopts x too: %v, %v", ok, err)
				}
				return nil
			}, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			sum := &Summary{Version: SummaryVersion, Node: "x", Tag: Tag("x"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
			if err := openAndPublish(fsys.OS{}, root, sum); err != nil {
				t.Fatal(err)
			}
			y, err := OpenDir(fsys.OS{}, root, "y")
			if err != nil {
				t.Fatal(err)
			}
			defer y.Close()
			if ok, err := y.Adopt("x"); !ok || err != nil {
				t.Fatalf("y adopts x: %v, %v", ok, err)
			}
			var once sync.Once
			retireFirst := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
				if op == fsys.OpLock {
					once.Do(func() {
						if ok, err := y.Retire("x"); !ok || err != nil {
							t.Errorf("y retires x: %v, %v", ok, err)
						}
					})
				}
				return fsys.Fault{}
			})
			check, err := tc.lock(t, root, &fsys.Faulty{FS: fsys.OS{}, Inj: retireFirst})
			if err != nil {
				t.Fatal(err)
			}
			if err := check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestOpenDirRemovesItsOwnSummaryTemporariesOnly: a node starting removes
// the summary temporaries it left (it died publishing), none of another
// node's.
func TestOpenDirRemovesItsOwnSummaryTemporariesOnly(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, DirName)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{ // name: removed
		".a.tmp-0123456789abcdef":    true,
		".ab.tmp-0123456789abcdef":   false,
		".a.b.tmp-0123456789abcdef":  false,
		".a.tmp-0123456789abcdef.x":  false,
		".a.tmp-0123456789abcdeg":    false,
		"a.tmp-0123456789abcdef":     false,
		".a.tmp-0123456789abcdef.tm": false,
	}
	for n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	a, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for n, removed := range names {
		if _, err := os.Stat(filepath.Join(dir, n)); errors.Is(err, os.ErrNotExist) != removed {
			t.Errorf("%s: removed %v, want %v", n, !removed, removed)
		}
	}
}

// TestDirGoesThroughItsFileSystem: each kind of operation the Dir makes
// reaches the file system it was given (here one that fails that kind
// with EIO), so that the engine's, which times every call, sees a hung
// shared mount in any of them.
func TestDirGoesThroughItsFileSystem(t *testing.T) {
	sum := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	for _, tc := range []struct {
		op   fsys.Op
		what string
		run  func(root string, fs fsys.FS) error // the operation fails within it
	}{
		{fsys.OpMkdir, "open dir", func(root string, fs fsys.FS) error { _, err := OpenDir(fs, root, "b"); return err }},
		{fsys.OpLock, "open dir", func(root string, fs fsys.FS) error { _, err := OpenDir(fs, root, "b"); return err }},
		{fsys.OpWrite, "publish", func(root string, fs fsys.FS) error { return openAndPublish(fs, root, sum) }},
		{fsys.OpSync, "publish", func(root string, fs fsys.FS) error { return openAndPublish(fs, root, sum) }},
		{fsys.OpRename, "publish", func(root string, fs fsys.FS) error { return openAndPublish(fs, root, sum) }},
		{fsys.OpReadDir, "read all", func(root string, fs fsys.FS) error { return openPublishAndRead(fs, root, sum) }},
		{fsys.OpRead, "read all", func(root string, fs fsys.FS) error { return openPublishAndRead(fs, root, sum) }},
		{fsys.OpOpen, "lock free", func(root string, fs fsys.FS) error {
			d, err := OpenDir(fsys.OS{}, root, "a")
			if err != nil {
				return err
			}
			defer d.Close()
			d.fs = fs // the lock file of a node, opened to test it
			_, err = d.LockFree("b")
			return err
		}},
		{fsys.OpOpen, "adopt", func(root string, fs fsys.FS) error { return openAndAdopt(fs, root, "b") }},
		{fsys.OpLock, "adopt", func(root string, fs fsys.FS) error { return openAndAdopt(fs, root, "b") }},
		{fsys.OpClose, "close dir", func(root string, fs fsys.FS) error {
			d, err := OpenDir(fs, root, "a") // the node's lock file, closed by Close
			if err != nil {
				return err
			}
			return d.Close()
		}},
		{fsys.OpClose, "close adoption", func(root string, fs fsys.FS) error {
			d, err := OpenDir(fsys.OS{}, root, "a")
			if err != nil {
				return err
			}
			d.fs = fs // an adoption lock, closed by Close
			if ok, err := d.Adopt("b"); !ok || err != nil {
				return fmt.Errorf("adopt: %v, %w", ok, err)
			}
			return d.Close()
		}},
	} {
		t.Run(tc.what+"/"+tc.op.String(), func(t *testing.T) {
			root := t.TempDir()
			if tc.op == fsys.OpOpen { // b's lock file exists, so LockFree opens it
				b, err := OpenDir(fsys.OS{}, root, "b")
				if err != nil {
					t.Fatal(err)
				}
				b.Close()
			}
			fs := &fsys.Faulty{FS: fsys.OS{}, Inj: &fsys.Counter{Ops: []fsys.Op{tc.op}, Fault: fsys.Fault{Err: syscall.EIO}, Sticky: true}}
			if err := tc.run(root, fs); !errors.Is(err, syscall.EIO) {
				t.Fatalf("with every %s failing: %v, want EIO", tc.op, err)
			}
		})
	}
}

// openAndPublish opens node s.Node's Dir on fs and publishes s.
func openAndPublish(fs fsys.FS, root string, s *Summary) error {
	d, err := OpenDir(fs, root, s.Node)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Publish(s)
}

// openAndAdopt opens node a's Dir with the operating system's file system
// and adopts node through fs.
func openAndAdopt(fs fsys.FS, root, node string) error {
	d, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		return err
	}
	defer d.Close()
	d.fs = fs
	_, err = d.Adopt(node)
	return err
}

// TestPublishRemovesItsTemporaryFileThroughItsFileSystem: a Publish whose
// write fails removes its temporary file, through the Dir's file system,
// and leaves the last summary in place.
func TestPublishRemovesItsTemporaryFileThroughItsFileSystem(t *testing.T) {
	root := t.TempDir()
	first := &Summary{Version: SummaryVersion, Node: "b", Tag: Tag("b"), Time: 1, Interval: 10, Bytes: 3, Claim: 4, Sketch: NewSketch([]Item{{5, 3}}, 8)}
	if err := openAndPublish(fsys.OS{}, root, first); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var removed []string
	fs := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		switch op {
		case fsys.OpWrite:
			return fsys.Fault{Err: syscall.EIO}
		case fsys.OpRemove:
			mu.Lock()
			removed = append(removed, filepath.Base(path))
			mu.Unlock()
		}
		return fsys.Fault{}
	})}
	second := *first
	second.Time = 2
	if err := openAndPublish(fs, root, &second); !errors.Is(err, syscall.EIO) {
		t.Fatalf("publish with every write failing: %v, want EIO", err)
	}
	if len(removed) != 1 || !strings.HasPrefix(removed[0], ".b.tmp-") {
		t.Fatalf("removed through the Dir's file system: %q, want one temporary file", removed)
	}
	ents, err := os.ReadDir(filepath.Join(root, DirName))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.Contains(e.Name(), ".tmp-") {
			t.Errorf("temporary file %s left behind", e.Name())
		}
	}
	d, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	sums, _, err := d.ReadAll()
	if err != nil || len(sums) != 1 || sums[0].Time != 1 {
		t.Fatalf("summaries after the failed publish: %+v, %v; want b's first", sums, err)
	}
}

// openPublishAndRead publishes s with the operating system's file
// system, then reads every summary through node a's Dir on fs.
func openPublishAndRead(fs fsys.FS, root string, s *Summary) error {
	if err := openAndPublish(fsys.OS{}, root, s); err != nil {
		return err
	}
	d, err := OpenDir(fsys.OS{}, root, "a")
	if err != nil {
		return err
	}
	defer d.Close()
	d.fs = fs
	_, bad, err := d.ReadAll()
	return errors.Join(append([]error{err}, bad...)...)
}

// TestDirReadsWholeFilesOfAnySize: readFile returns every byte of files
// empty, below, at and above its first buffer, and many times it.
func TestDirReadsWholeFilesOfAnySize(t *testing.T) {
	d := &Dir{fs: fsys.OS{}}
	for _, n := range []int{0, 1, 4095, 4096, 4097, 8192, 100000} {
		p := filepath.Join(t.TempDir(), "f")
		want := bytes.Repeat([]byte{7}, n)
		if err := os.WriteFile(p, want, 0o644); err != nil {
			t.Fatal(err)
		}
		if got, err := d.readFile(p); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("a file of %d bytes: read %d bytes, %v", n, len(got), err)
		}
	}
}

// TestDirRefusesASummaryFileLargerThanMaxSummarySize: readFile stops
// reading past MaxSummarySize bytes and reports ErrSummary.
func TestDirRefusesASummaryFileLargerThanMaxSummarySize(t *testing.T) {
	d := &Dir{fs: fsys.OS{}}
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, bytes.Repeat([]byte{' '}, MaxSummarySize+1), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := d.readFile(p); !errors.Is(err, ErrSummary) {
		t.Fatalf("a file of %d bytes: read %d bytes, %v; want ErrSummary", MaxSummarySize+1, len(got), err)
	}
}

// TestWatchKeepsACutOnlyWhileItsSummaryIsRecentAsTheReaderSawIt: a
// peer's cut is in force while its age at publication (peer's clock)
// plus the time since the reader saw the summary change (reader's clock)
// is within the window; a summary never seen to change has no known age.
func TestWatchKeepsACutOnlyWhileItsSummaryIsRecentAsTheReaderSawIt(t *testing.T) {
	const iv = int64(1e9)
	peer := func(seq uint64, time, cutAge int64) *Summary {
		return &Summary{Node: "p", Seq: seq, Time: time, Cut: 7, CutTime: time - cutAge}
	}
	var w Watch
	cut := func(s *Summary, now int64) uint64 { return w.Cuts([]*Summary{s}, now, 2*iv)[0].Cut }
	first := peer(1, -5000*iv, 0) // the peer's clock far behind the reader's
	w.See([]*Summary{first}, 100*iv)
	if got := cut(first, 100*iv); got != 0 {
		t.Fatalf("a cut of a summary never seen to change: in force (%d), want not", got)
	}
	next := peer(2, -4999*iv, iv)
	w.See([]*Summary{next}, 101*iv)
	if got := cut(next, 101*iv); got != 7 {
		t.Fatalf("a cut 1 interval old just seen: cut %d, want 7", got)
	}
	if next.Cut != 7 {
		t.Fatal("Cuts changed the summary it was given")
	}
	w.See([]*Summary{next}, 102*iv+1) // unchanged: stalled
	if got := cut(next, 102*iv+1); got != 0 {
		t.Fatalf("a cut 1 interval old at publication, its summary unchanged 1 interval more and a bit: cut %d, want none", got)
	}
	if got := cut(next, 101*iv+iv/2); got != 7 {
		t.Fatalf("a cut 1.5 intervals old by the sum: cut %d, want 7", got)
	}
	w.See(nil, 103*iv) // forgotten, then seen anew: unknown again
	w.See([]*Summary{next}, 104*iv)
	if got := cut(next, 104*iv); got != 0 {
		t.Fatalf("a summary seen anew after the peer was gone: cut %d, want none", got)
	}
}

// TestAVersion1SummaryWithoutABoundIsRead: a summary of a node before
// the bound was published (version 1: no capacity, policy, run or
// untagged bytes) decodes, those fields zero, and takes no part in the
// agreement on the bound.
func TestAVersion1SummaryWithoutABoundIsRead(t *testing.T) {
	old := fmt.Sprintf(`{"version":1,"node":"old","tag":%d,"seq":4,"time":5,"interval":10,"bytes":30,"claim":40,"sketch":{"ranks":[1],"bytes":[30]}}`, Tag("old"))
	s, err := Decode([]byte(old))
	if err != nil {
		t.Fatalf("a version-1 summary does not decode: %v", err)
	}
	if s.Capacity != 0 || s.Policy != "" || s.Run != 0 || s.Untagged != 0 || s.Claim != 40 {
		t.Fatalf("a version-1 summary read as %+v: want claim 40 and no capacity, policy, run or untagged bytes", s)
	}
	if bound, from := Agree(100, "me", []*Summary{s}); bound != 100 || from != "me" {
		t.Fatalf("Agree beside a version-1 node: %d from %q, want this node's 100", bound, from)
	}
}

// TestAgreeTakesTheSmallestConfiguredCapacity: the bound is the smallest
// capacity among this node and the peers that state one, ties to the
// smallest name, so that every node names the same source.
func TestAgreeTakesTheSmallestConfiguredCapacity(t *testing.T) {
	peer := func(node string, capacity int64) *Summary { return &Summary{Node: node, Capacity: capacity} }
	tests := []struct {
		name      string
		own       int64
		peers     []*Summary
		bound     int64
		boundFrom string
	}{
		{"alone", 800, nil, 800, "me"},
		{"a smaller peer", 800, []*Summary{peer("a", 100), peer("b", 100)}, 100, "a"},
		{"this node the smallest", 100, []*Summary{peer("a", 800)}, 100, "me"},
		{"a tie goes to the smallest name", 100, []*Summary{peer("a", 100)}, 100, "a"},
		{"a peer stating none", 100, []*Summary{peer("a", 0)}, 100, "me"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if b, from := Agree(tc.own, "me", tc.peers); b != tc.bound || from != tc.boundFrom {
				t.Fatalf("Agree: %d from %q, want %d from %q", b, from, tc.bound, tc.boundFrom)
			}
		})
	}
}

// TestAClaimBeyondTheBoundCannotHold: a claim above the bound cannot
// hold (Untenable names it), one within it can; a summary stating fewer
// bytes than the files seen of its node counts the files (AtLeast).
func TestAClaimBeyondTheBoundCannotHold(t *testing.T) {
	s := &Summary{Node: "x", Bytes: 10, Claim: MaxBytes}
	if why := Untenable(s, 1000); !strings.Contains(why, "more than the cluster's bound") {
		t.Fatalf("a claim of 2^62 under a bound of 1000: %q, want it untenable", why)
	}
	s.Claim = 1000
	if why := Untenable(s, 1000); why != "" {
		t.Fatalf("a claim of the whole bound: %q, want it tenable", why)
	}
	g := AtLeast(&Summary{Node: "x", Bytes: 0, Claim: 0}, 300)
	if g.Bytes != 300 || g.Claim != 300 {
		t.Fatalf("a summary of 0 bytes beside 300 bytes of its files: counted %d, claim %d; want 300", g.Bytes, g.Claim)
	}
}

// TestOddRanksTellsSecondsFromNanoseconds: ranks in Unix seconds (or a
// constant) are on another scale than Unix nanoseconds of use.
func TestOddRanksTellsSecondsFromNanoseconds(t *testing.T) {
	now := int64(1_800_000_000) * 1e9
	for _, tc := range []struct {
		name string
		top  uint64
		odd  bool
	}{{"nanoseconds", uint64(now - 1e9), false}, {"seconds", uint64(now / 1e9), true}, {"zero", 0, true}} {
		sk := Sketch{Ranks: []uint64{0, tc.top}, Bytes: []int64{1, 2}}
		if got := OddRanks(sk, now); got != tc.odd {
			t.Errorf("%s: OddRanks %v, want %v", tc.name, got, tc.odd)
		}
	}
}

func TestShareIsAnEqualPartOfWhatTheRestLeaves(t *testing.T) {
	b := Bound{Capacity: 3000, High: 2700, Low: 2400}
	for _, tc := range []struct {
		nodes int
		rest  int64
		want  int64
	}{
		{3, 0, 1000},
		{3, 600, 800},
		{1, 0, 3000},
		{0, 0, 3000},    // no live node counted: this one alone
		{2, 5000, 0},    // the rest takes the whole bound
		{4, 1 << 62, 0}, // a saturated rest
	} {
		if got := b.Share(tc.nodes, tc.rest); got != tc.want {
			t.Errorf("Share(%d nodes, rest %d) of %d = %d, want %d", tc.nodes, tc.rest, b.Capacity, got, tc.want)
		}
	}
}
