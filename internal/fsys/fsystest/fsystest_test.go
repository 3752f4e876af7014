package fsystest

import (
	"slices"
	"testing"
)

func TestPartlyFirstWrittenFindsFoliosCutByTheirFirstWrite(t *testing.T) {
	const folio = 100
	for _, c := range []struct {
		name   string
		writes [][2]int64
		want   []int64
	}{
		{"whole folios", [][2]int64{{0, 100}, {100, 300}}, nil},
		{"a header's folio, then the rest of it", [][2]int64{{10, 100}, {0, 10}}, []int64{0}},
		{"a file's last folio, written in part only", [][2]int64{{0, 100}, {100, 150}}, nil},
		{"a write that crosses into the next folio first", [][2]int64{{0, 110}, {110, 200}}, []int64{1}},
		{"pieces smaller than a folio", [][2]int64{{0, 25}, {25, 50}, {50, 100}}, []int64{0}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := PartlyFirstWritten(c.writes, folio)
			slices.Sort(got)
			if !slices.Equal(got, c.want) {
				t.Fatalf("folios %v, want %v", got, c.want)
			}
		})
	}
}
