package outcome

import "testing"

// TestNamesAreTheProtocolsAndUnknownValuesSayTheirNumber: each outcome
// and reason has the name docs/protocol.md gives it, at its wire value,
// and a value past them names its number.
func TestNamesAreTheProtocolsAndUnknownValuesSayTheirNumber(t *testing.T) {
	for _, tc := range []struct {
		got  interface{ String() string }
		want string
	}{
		{Pending, "pending"}, {Stored, "stored"}, {Present, "present"}, {NotAdmitted, "not admitted"},
		{Loaded, "loaded"}, {Missing, "missing"}, {Failed, "failed"}, {Cancelled, "cancelled"},
		{Outcome(8), "outcome(8)"},
		{Evicted, "evicted"}, {ClusterEvicted, "cluster-evicted"}, {Deleted, "deleted"}, {Purged, "purged"},
		{Corrupt, "corrupt"}, {Vanished, "vanished"}, {Moved, "moved"},
		{Reason(0), "reason(0)"}, {Reason(9), "reason(9)"},
	} {
		if s := tc.got.String(); s != tc.want {
			t.Errorf("%#v.String() = %q, want %q", tc.got, s, tc.want)
		}
	}
	if Cancelled != 7 || Failed != 6 || Moved != 7 || Evicted != 1 {
		t.Fatalf("wire values moved: cancelled %d, failed %d, moved %d, evicted %d", Cancelled, Failed, Moved, Evicted)
	}
}
