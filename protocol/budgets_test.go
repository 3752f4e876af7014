package protocol

import (
	"reflect"
	"strings"
	"testing"
)

// budgetStats is a Stats reply with every section up to the
// mount-failures one, and daemon section d.
func budgetStats(d *DaemonStats, nl *NamespaceList) *Stats {
	return &Stats{Mounts: []MountStats{{Capacity: 10}}, Daemon: d, Spares: &SpareStats{Mounts: []SpareMount{{}}},
		Tiering: &TierStats{Mounts: []TierMount{{}}}, StoresFailing: []MountFailure{{}}, Namespaces: nl}
}

// budgetMessages are the sample Stats replies with a budgets section
// (round trips, fuzz seeds).
func budgetMessages() []Message {
	return []Message{
		budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: []BudgetStats{
			{Model: "vllm:meta-llama_Llama-3.1-8B-Instruct:*", Used: 3 << 30, Budget: 4 << 30, Floor: 1 << 30, Over: 7, Kept: 2},
			{Model: "vllm:Qwen_Qwen3-32B:*", Budget: 1 << 40}}, BudgetsLeftOut: 1},
			&NamespaceList{List: []NamespaceStats{{Fingerprint: 1, Model: "vllm:Qwen_Qwen3-32B:0", Files: 1, Keys: 1, Bytes: 4096, Caches: 1}}}),
		budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: []BudgetStats{}}, &NamespaceList{}),
	}
}

// TestStatsBudgetsSection: the budgets section round-trips with and
// without budgets and namespaces listed; a daemon without budgets sends
// an empty list (none), one that predates the section sends nothing (nil:
// unknown), and a reply with budgets but no namespaces list carries an
// empty one, which the section comes after.
func TestStatsBudgetsSection(t *testing.T) {
	two := []BudgetStats{{Model: "a:*", Used: 5, Budget: 10, Floor: 2, Over: 3, Kept: 4}, {Model: "b", Floor: 1 << 30}}
	ns := &NamespaceList{List: []NamespaceStats{{Fingerprint: 9, Model: "a:1", Declared: true, Files: 1, Keys: 2, Bytes: 5, Caches: 1}}}
	for _, tc := range []struct {
		name string
		sent *Stats
		want *Stats // nil: sent
	}{
		{"two budgets", budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: two}, ns), nil},
		{"two budgets, some left out", budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: two, BudgetsLeftOut: 3}, ns), nil},
		{"a daemon without budgets", budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: []BudgetStats{}}, ns), nil},
		{"a daemon that predates budgets", budgetStats(&DaemonStats{Mounts: []MountInfo{{}}}, ns), nil},
		{"budgets without a namespaces list", budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: two}, nil),
			budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: two}, &NamespaceList{})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := tc.want
			if want == nil {
				want = tc.sent
			}
			got, err := Decode(TypeStats|TypeReply, tc.sent.AppendBody(nil))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("decoded %+v (daemon %+v), want %+v (daemon %+v)", got, got.(*Stats).Daemon, want, want.Daemon)
			}
		})
	}
}

// TestStatsOfADaemonBeforeBudgetsHasNone: a reply that ends after the
// caches section (a daemon that predates the budgets section) decodes,
// with Budgets nil; bytes after the classes section (a later daemon's)
// are ignored.
func TestStatsOfADaemonBeforeBudgetsHasNone(t *testing.T) {
	old := budgetStats(&DaemonStats{Policy: "lru", Mounts: []MountInfo{{Path: "/kv"}}},
		&NamespaceList{List: []NamespaceStats{{Fingerprint: 9, Model: "m", Files: 1, Caches: 2}}})
	got, err := Decode(TypeStats|TypeReply, old.AppendBody(nil))
	if err != nil {
		t.Fatal(err)
	}
	if st := got.(*Stats); st.Daemon.Budgets != nil || !reflect.DeepEqual(st, old) {
		t.Fatalf("decoded %+v (budgets %+v), want %+v without budgets", st, st.Daemon.Budgets, old)
	}
	later := budgetStats(&DaemonStats{Mounts: []MountInfo{{Class: "memory"}}, Budgets: []BudgetStats{{Model: "m", Used: 1}}}, &NamespaceList{})
	got, err = Decode(TypeStats|TypeReply, append(later.AppendBody(nil), 0xde, 0xad))
	if err != nil || !reflect.DeepEqual(got, later) {
		t.Fatalf("a reply with a section after the classes: %v, %+v; want %+v", err, got, later)
	}
}

// TestStatsBudgetsBounds: a list longer than MaxStatsBudgets is sent cut
// to its first MaxStatsBudgets, the rest counted as left out, each
// pattern cut to 255 bytes; a count over the bound, and a section cut
// short, are refused.
func TestStatsBudgetsBounds(t *testing.T) {
	list := make([]BudgetStats, MaxStatsBudgets+3)
	for i := range list {
		list[i] = BudgetStats{Model: strings.Repeat("m", 300), Used: uint64(i)}
	}
	m := budgetStats(&DaemonStats{Mounts: []MountInfo{{}}, Budgets: list, BudgetsLeftOut: 1}, &NamespaceList{})
	b := m.AppendBody(nil)
	got, err := Decode(TypeStats|TypeReply, b)
	if err != nil {
		t.Fatal(err)
	}
	d := got.(*Stats).Daemon
	if len(d.Budgets) != MaxStatsBudgets || d.BudgetsLeftOut != 4 || d.Budgets[5].Used != 5 || len(d.Budgets[0].Model) != 255 {
		t.Fatalf("decoded %d budgets (the first's pattern %d bytes), %d left out; want %d (255 bytes), 4",
			len(d.Budgets), len(d.Budgets[0].Model), d.BudgetsLeftOut, MaxStatsBudgets)
	}
	section := len(b) - len(budgetStats(&DaemonStats{Mounts: []MountInfo{{}}}, &NamespaceList{}).AppendBody(nil))
	over := append([]byte{}, b[:len(b)-section]...)
	over = append(over, byte(MaxStatsBudgets+1), 0, 0, 0)
	over = append(over, make([]byte, 8+(MaxStatsBudgets+1)*41)...)
	for name, body := range map[string][]byte{"over the bound": over, "cut short": b[:len(b)-1], "count past the body": b[:len(b)-section+4+8+40]} {
		if _, err := Decode(TypeStats|TypeReply, body); err == nil {
			t.Errorf("budgets section %s decoded", name)
		}
	}
}

// TestStatsClassesSection: each mount's device class round-trips after
// the budgets section; a reply that ends before it (a daemon that
// predates it) leaves the classes empty; a count other than the mounts'
// and a name over maxClassName bytes are refused.
func TestStatsClassesSection(t *testing.T) {
	mounts := []MountInfo{{Path: "/dev/shm/kv", Class: "memory"}, {Path: "/nvme/kv", Class: "nvme"}}
	sent := budgetStats(&DaemonStats{Mounts: mounts, Budgets: []BudgetStats{}}, &NamespaceList{})
	sent.Mounts = []MountStats{{Capacity: 10}, {Capacity: 20}}
	sent.Spares.Mounts, sent.Tiering.Mounts, sent.StoresFailing = []SpareMount{{}, {}}, []TierMount{{}, {}}, []MountFailure{{}, {}}
	b := sent.AppendBody(nil)
	got, err := Decode(TypeStats|TypeReply, b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, sent) {
		t.Fatalf("decoded %+v, want %+v", got.(*Stats).Daemon.Mounts, mounts)
	}
	section := 4 + 1 + len("memory") + 1 + len("nvme")
	got, err = Decode(TypeStats|TypeReply, b[:len(b)-section])
	if err != nil {
		t.Fatalf("a reply of a daemon before the classes section: %v", err)
	}
	for i, mt := range got.(*Stats).Daemon.Mounts {
		if mt.Class != "" {
			t.Errorf("mount %d: class %q from a reply without the section", i, mt.Class)
		}
	}
	for _, tc := range []struct {
		name, want string
		body       []byte
	}{
		{"one class for two mounts", "classes section of 1 mounts after 2",
			append(appendU32(b[:len(b)-section:len(b)-section], 1), 6, 'm', 'e', 'm', 'o', 'r', 'y')},
		{"a name too long", "mount class length 17",
			append(append(appendU32(b[:len(b)-section:len(b)-section], 2), 17), []byte(strings.Repeat("x", 17)+"\x04nvme")...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Decode(TypeStats|TypeReply, tc.body); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("decode: %v, want an error naming %q", err, tc.want)
			}
		})
	}
}
