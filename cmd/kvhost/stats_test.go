package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/protocol"
)

func TestGPUUUIDIsWrittenAsNvidiaSmiWritesIt(t *testing.T) {
	cases := []struct {
		name string
		uuid [16]byte
		want string
	}{
		{"unknown", [16]byte{}, ""},
		{"an H200", [16]byte{0xb5, 0x2f, 0x41, 0x89, 0x5e, 0x10, 0x38, 0x62, 0xc8, 0xb5, 0x0e, 0x94, 0x47, 0xd3, 0x8f, 0x9f},
			"GPU-b52f4189-5e10-3862-c8b5-0e9447d38f9f"},
	}
	for _, c := range cases {
		if got := gpuUUID(c.uuid); got != c.want {
			t.Errorf("%s: gpuUUID = %q, want %q", c.name, got, c.want)
		}
	}
}

// TestHealthFailsOnAFallenBackPolicyOrABrokenGPU: `kvhost health` judges
// the daemon's Stats: a GPU with a job that failed on a sticky CUDA error
// (its context broken until the daemon restarts) makes it unhealthy, so
// that a liveness probe restarts it, unless --allow-device-faults; a
// fallen-back policy only with --allow-fallback=false.
func TestHealthFailsOnAFallenBackPolicyOrABrokenGPU(t *testing.T) {
	healthy := statsReport{Devices: []statsDevice{{Ordinal: 0}, {Ordinal: 1}}}
	broken := statsReport{Devices: []statsDevice{{Ordinal: 0}, {Ordinal: 1, Faults: 2}}}
	fellBack := statsReport{}
	fellBack.Policy.Name, fellBack.Policy.Fallback, fellBack.Policy.FallbackReason = "lfu", true, "trap"
	for _, tc := range []struct {
		name                       string
		r                          statsReport
		allowFallback, allowFaults bool
		want                       string // in the reason; "" for healthy
	}{
		{"healthy GPUs", healthy, false, false, ""},
		{"no GPU", statsReport{}, false, false, ""},
		{"a broken GPU", broken, true, false, "2 device faults on GPU 1 (jobs or registrations that failed with a sticky CUDA error"},
		{"a broken GPU, faults allowed", broken, true, true, ""},
		{"a fallen-back policy", fellBack, false, false, "the policy lfu fell back to its native fallback: trap"},
		{"a fallen-back policy, allowed", fellBack, true, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := unhealthy(tc.r, healthOptions{allowFallback: tc.allowFallback, allowFaults: tc.allowFaults, allowFailingMounts: true})
			if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
				t.Fatalf("unhealthy = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestStatsJSONHasTheDocumentedFieldsAndArrays: `kvhost stats --json`
// against a daemon (run in this process) prints the top-level fields
// docs/serve.md lists, and its lists (mounts, gpu_devices) are JSON
// arrays (namespaces and budgets too), empty where there is nothing to
// list, never null: a script that iterates over the GPU devices of a node
// without a GPU gets none.
func TestStatsJSONHasTheDocumentedFieldsAndArrays(t *testing.T) {
	ctx, socket := serveTestConfig(t)

	var out, errb bytes.Buffer
	if code := run(ctx, []string{"stats", "--socket", socket, "--json"}, &out, &errb); code != 0 {
		t.Fatalf("kvhost stats --json: exit %d: %s", code, errb.String())
	}
	var got map[string]any
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatalf("kvhost stats --json is not JSON: %v\n%s", err, out.String())
	}
	for _, k := range []string{"socket", "version", "started", "uptime", "policy", "reloads", "clients", "inflight_jobs",
		"regions", "registered_bytes", "entries", "keys", "counters", "tiering", "mounts", "gpu_devices", "namespaces", "budgets"} {
		if _, ok := got[k]; !ok {
			t.Errorf("no %q in kvhost stats --json:\n%s", k, out.String())
		}
	}
	for _, k := range []string{"mounts", "gpu_devices", "namespaces", "budgets"} {
		if _, ok := got[k].([]any); !ok {
			t.Errorf("kvhost stats --json: %q is %v, want an array", k, got[k])
		}
	}
}

// TestHealthWarnsOfAMountThatRefusesStores: a mount that refuses stores
// is a warning naming the mount and the last error, not a failure,
// unless --allow-failing-mounts=false; mounts that store give none.
func TestHealthWarnsOfAMountThatRefusesStores(t *testing.T) {
	refusing := statsReport{Mounts: []statsMount{{Path: "/nvme/kv"},
		{Path: "/mnt/ro", StoresFailing: &statsFailing{Since: time.Unix(1700000000, 0).UTC(), Stores: 4, Err: "open: read-only file system"}}}}
	for _, tc := range []struct {
		name          string
		r             statsReport
		allow         bool
		warn, failure string // in the warnings, in the reason; "" for none
	}{
		{"mounts that store", statsReport{Mounts: []statsMount{{Path: "/nvme/kv"}}}, true, "", ""},
		{"a mount that refuses stores", refusing, true, "mount /mnt/ro refuses stores since 2023-11-14T22:13:20Z (4 failed since the last that succeeded): open: read-only file system", ""},
		{"a mount that refuses stores, not allowed", refusing, false, "mount /mnt/ro refuses stores", "mount /mnt/ro refuses stores"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := strings.Join(healthWarnings(tc.r), "\n")
			why := unhealthy(tc.r, healthOptions{allowFallback: true, allowFailingMounts: tc.allow})
			if tc.warn == "" && w != "" || !strings.Contains(w, tc.warn) {
				t.Errorf("warnings %q, want %q", w, tc.warn)
			}
			if tc.failure == "" && why != "" || !strings.Contains(why, tc.failure) {
				t.Errorf("unhealthy = %q, want %q", why, tc.failure)
			}
		})
	}
}

// TestStatsListsEachNamespaceWithItsKeys: `kvhost stats` names each
// namespace a client declared by its model id, with the keys, files and
// bytes stored in it and the caches registered in it now (and --json
// alike), so that an operator can tell which models share a node's cache,
// how much each holds and whether an engine's workers are connected.
func TestStatsListsEachNamespaceWithItsKeys(t *testing.T) {
	ctx, socket := serveTestConfig(t)
	storeThreeKeys(t, ctx, socket)
	st := statsJSON(t, ctx, socket)
	if len(st.Namespaces) != 1 {
		t.Fatalf("kvhost stats --json namespaces: %+v, want the one declared", st.Namespaces)
	}
	ns := st.Namespaces[0]
	if ns.Model != opsGeo.Model || !ns.Declared || ns.Keys != 3 || ns.Files == 0 || ns.Bytes == 0 || len(ns.Fingerprint) != 16 || ns.Caches != 1 {
		t.Fatalf("namespace %+v: want %q declared, with its 3 keys, their files and bytes, and the one cache registered", ns, opsGeo.Model)
	}
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"stats", "--socket", socket}, &out, &errb); code != 0 {
		t.Fatalf("kvhost stats: exit %d: %s", code, errb.String())
	}
	line := ""
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.Contains(l, opsGeo.Model) {
			line = l
		}
	}
	if !strings.Contains(out.String(), "namespaces:") || !strings.Contains(line, ns.Fingerprint) || !strings.Contains(line, " 3 ") {
		t.Fatalf("kvhost stats:\n%s\nwant a namespaces section with %s, its fingerprint and 3 keys", out.String(), opsGeo.Model)
	}
}

// storeThreeKeys stores keys a, b and c of opsGeo through a client of the
// daemon at socket, its cache registered until the test ends.
func storeThreeKeys(t *testing.T, ctx context.Context, socket string) {
	t.Helper()
	k := newKVCache(t, socket)
	for i, key := range []string{"a", "b", "c"} {
		res, err := k.do(ctx, true, key, []uint32{uint32(2 * i), uint32(2*i + 1)})
		if err != nil || res.Count(protocol.OutcomeStored) != 1 {
			t.Fatalf("store %s: %+v, %v", key, res, err)
		}
	}
}

// serveTestConfig runs a daemon of testConfig's configuration in this
// process until the test ends (its exit status checked then), and returns
// a context the test's calls use and the daemon's socket, once it listens.
func serveTestConfig(t *testing.T) (context.Context, string) {
	t.Helper()
	file, socket, _ := testConfig(t, t.TempDir(), "")
	serveUntilDone(t, t.Context(), file, socket)
	return t.Context(), socket
}

// TestStatsNamespacesTableKeepsItsColumnsWhateverTheModelIds: the
// namespaces table puts the model id, free text of any width (tabwriter
// counts a CJK rune as one column where a terminal shows two), after every
// other column, so the fingerprint, keys, files and bytes of each row
// start where the header's do.
func TestStatsNamespacesTableKeepsItsColumnsWhateverTheModelIds(t *testing.T) {
	var out bytes.Buffer
	printStats(&out, statsReport{Namespaces: []statsNamespace{
		{Fingerprint: "00000000000000a1", Model: "通义千问-72B", Declared: true, Keys: 12345, Files: 12, Bytes: 3 << 30},
		{Fingerprint: "00000000000000b2", Model: "meta-llama/Llama-3.1-8B", Declared: true, Keys: 7, Files: 1, Bytes: 1 << 20},
		{Fingerprint: "00000000000000c3", Keys: 1, Files: 1, Bytes: 4096},
	}})
	_, table, ok := strings.Cut(out.String(), "namespaces:\n")
	if !ok {
		t.Fatalf("no namespaces section in:\n%s", out.String())
	}
	lines := strings.Split(strings.TrimRight(table, "\n"), "\n")
	if len(lines) != 4 {
		t.Fatalf("namespaces table:\n%s\nwant a header and 3 rows", table)
	}
	for _, col := range []string{"fingerprint", "keys", "files", "bytes", "caches", "model"} {
		at := strings.Index(lines[0], col) // the header is ASCII: bytes are columns
		for _, l := range lines[1:] {
			cells := displayCells(l)
			if at >= len(cells) || cells[at] == ' ' || cells[at-1] != ' ' {
				t.Errorf("row %q: no cell starts at the display column of %q (%d):\n%s", l, col, at, table)
			}
		}
	}
	if !strings.Contains(lines[1], "通义千问-72B") || !strings.Contains(lines[3], "no client declared it") {
		t.Errorf("table:\n%s\nwant each row's model id, and the undeclared namespace said so", table)
	}
}

// displayCells lays s out as a terminal shows it: one cell per column, a
// wide (East Asian) rune taking two, its second cell 0.
func displayCells(s string) []rune {
	var cells []rune
	for _, r := range s {
		cells = append(cells, r)
		if wideRune(r) {
			cells = append(cells, 0)
		}
	}
	return cells
}

// wideRune reports whether a terminal shows r two columns wide, for the
// ranges this package's tests use (CJK ideographs, kana, Hangul, full-width
// forms).
func wideRune(r rune) bool {
	return (r >= 0x1100 && r <= 0x115f) || (r >= 0x2e80 && r <= 0xa4cf) ||
		(r >= 0xac00 && r <= 0xd7a3) || (r >= 0xf900 && r <= 0xfaff) ||
		(r >= 0xff00 && r <= 0xff60) || (r >= 0xffe0 && r <= 0xffe6)
}

// TestStatsNamesTheCapacityAndTheConfiguredOne: kvhost stats printed the
// effective capacity (limited by the free space) where kvhost check
// printed the configured one, both as "capacity": stats now shows both,
// named as check names them, and says why the capacity is below.
func TestStatsNamesTheCapacityAndTheConfiguredOne(t *testing.T) {
	var out bytes.Buffer
	printStats(&out, statsReport{Mounts: []statsMount{
		{Path: "/nvme", Capacity: 75 << 30, Configured: 227 << 30, Used: 1 << 30},
	}})
	header := regexp.MustCompile(`(?m)^  path +backend +io +checksums +used +capacity +configured +use%`)
	row := regexp.MustCompile(`(?m)^  /nvme .* 1(\.0)?GiB +75(\.0)?GiB +227(\.0)?GiB +1\.3%`)
	if !header.MatchString(out.String()) || !row.MatchString(out.String()) || !strings.Contains(out.String(), "capacity below configured") {
		t.Errorf("stats lacks the capacity and the configured capacity, named:\n%s", out.String())
	}
}

// TestStatsNamesEachMountsDeviceClass: `kvhost stats --json` gives each
// mount's device class as the daemon configured it, and the text shows
// it in the mounts table.
func TestStatsNamesEachMountsDeviceClass(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	conf := strings.Replace(string(b), "[[mount]]\n", "[[mount]]\ndevice_class = \"nvme\"\n", 1)
	if conf == string(b) {
		t.Fatalf("no [[mount]] table in the test's configuration:\n%s", b)
	}
	if err := os.WriteFile(file, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	serveUntilDone(t, ctx, file, socket)
	st := statsJSON(t, ctx, socket)
	if len(st.Mounts) != 1 || st.Mounts[0].Class != "nvme" {
		t.Fatalf("mounts %+v, want one of class nvme", st.Mounts)
	}
	var out bytes.Buffer
	printStats(&out, st)
	if !regexp.MustCompile(`(?m)^  \S+ .* nvme$`).MatchString(out.String()) {
		t.Errorf("the mounts table lacks the class:\n%s", out.String())
	}
}

// TestStatsShowsEachBudgetAgainstItsUse: `kvhost stats` against a daemon
// (run in this process) with two [[budget]] tables prints a budgets
// section of one line per budget, in configuration order: the bytes its
// namespaces hold against its budget and floor, and the evictions it
// caused and its floor prevented; --json has the same under "budgets".
// The namespace stored in counts against the budget whose pattern
// matches its model id; the other budget holds nothing.
func TestStatsShowsEachBudgetAgainstItsUse(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "[[budget]]\nmodel = \"ops/*\"\nbytes = \"1MiB\"\nfloor = \"64KiB\"\n\n"+
		"[[budget]]\nmodel = \"vllm:other:*\"\nfloor = \"2MiB\"\n")
	ctx := t.Context()
	serveUntilDone(t, ctx, file, socket)
	storeThreeKeys(t, ctx, socket)
	st := statsJSON(t, ctx, socket)
	if len(st.Namespaces) != 1 || st.Namespaces[0].Bytes == 0 {
		t.Fatalf("namespaces %+v, want the one stored in", st.Namespaces)
	}
	used := st.Namespaces[0].Bytes
	want := []statsBudget{{Model: "ops/*", Used: used, Budget: 1 << 20, Floor: 64 << 10}, {Model: "vllm:other:*", Floor: 2 << 20}}
	if !slices.Equal(st.Budgets, want) || st.BudgetsLeftOut != 0 {
		t.Fatalf("kvhost stats --json budgets %+v (%d left out), want %+v", st.Budgets, st.BudgetsLeftOut, want)
	}
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"stats", "--socket", socket}, &out, &errb); code != 0 {
		t.Fatalf("kvhost stats: exit %d: %s", code, errb.String())
	}
	_, section, ok := strings.Cut(out.String(), "\nbudgets:\n")
	if !ok {
		t.Fatalf("kvhost stats:\n%s\nwant a budgets section", out.String())
	}
	pct := fmt.Sprintf("%.1f%%", 100*float64(used)/(1<<20))
	rows := []*regexp.Regexp{
		regexp.MustCompile(`(?m)^  used +budget +use% +floor +evicted over budget +kept by floor +model$`),
		regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(bytesString(used)) + ` +1MiB +` + regexp.QuoteMeta(pct) + ` +64KiB +0 +0 +ops/\*$`),
		regexp.MustCompile(`(?m)^  0B +none +- +2MiB +0 +0 +vllm:other:\*$`),
	}
	for _, re := range rows {
		if !re.MatchString(section) {
			t.Errorf("budgets section:\n%s\nhas no line matching %s", section, re)
		}
	}
}

// TestStatsBudgetsSection: the budgets section of `kvhost stats` prints
// one line per budget with its use against its budget (or none: a floor
// only) and floor, in human units, and the evictions it caused and its
// floor prevented, and how many the reply left out; nothing where the
// daemon has no budgets or predates them.
func TestStatsBudgetsSection(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    statsReport
		want []string // lines of the section, as regular expressions; none: no section
	}{
		{"no budgets", statsReport{Budgets: []statsBudget{}}, nil},
		{"a daemon that predates budgets", statsReport{}, nil},
		{"over its budget, and a floor only", statsReport{Budgets: []statsBudget{
			{Model: "vllm:meta-llama_Llama-3.1-8B-Instruct:*", Used: 3 << 30, Budget: 2 << 30, Floor: 512 << 20, OverEvictions: 1234, FloorSkips: 0},
			{Model: "tenant/quiet", Used: 100 << 20, Floor: 1 << 30, FloorSkips: 56},
		}, BudgetsLeftOut: 2}, []string{
			`^  3GiB +2GiB +150\.0% +512MiB +1234 +0 +vllm:meta-llama_Llama-3\.1-8B-Instruct:\*$`,
			`^  100MiB +none +- +1GiB +0 +56 +tenant/quiet$`,
			`^  and 2 more`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			printStats(&out, tc.r)
			_, section, ok := strings.Cut(out.String(), "\nbudgets:\n")
			if ok != (tc.want != nil) {
				t.Fatalf("kvhost stats:\n%s\nbudgets section: %v, want %v", out.String(), ok, tc.want != nil)
			}
			for _, w := range tc.want {
				if !regexp.MustCompile(`(?m)` + w).MatchString(section) {
					t.Errorf("budgets section:\n%s\nhas no line matching %s", section, w)
				}
			}
		})
	}
}

// TestStatsReportsBudgetsAsTheDaemonSends: the report's budgets are null
// from a daemon that predates them (no daemon section, or no budgets
// section), an empty list from one without budgets, and each budget's
// figures otherwise.
func TestStatsReportsBudgetsAsTheDaemonSends(t *testing.T) {
	two := []protocol.BudgetStats{{Model: "a:*", Used: 1, Budget: 2, Floor: 3, Over: 4, Kept: 5}, {Model: "b"}}
	for _, tc := range []struct {
		name string
		d    *protocol.DaemonStats
		want []statsBudget
		left uint64
	}{
		{"no daemon section", nil, nil, 0},
		{"no budgets section", &protocol.DaemonStats{}, nil, 0},
		{"no budgets", &protocol.DaemonStats{Budgets: []protocol.BudgetStats{}}, []statsBudget{}, 0},
		{"two budgets, one left out", &protocol.DaemonStats{Budgets: two, BudgetsLeftOut: 1},
			[]statsBudget{{Model: "a:*", Used: 1, Budget: 2, Floor: 3, OverEvictions: 4, FloorSkips: 5}, {Model: "b"}}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, left := reportBudgets(tc.d)
			if (got == nil) != (tc.want == nil) || !slices.Equal(got, tc.want) || left != tc.left {
				t.Fatalf("reportBudgets = %#v, %d; want %#v, %d", got, left, tc.want, tc.left)
			}
		})
	}
}
