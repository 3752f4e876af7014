package index

import "testing"

func TestCheckedCoversOnlyTheLayersMarkedOfEveryKeyAsked(t *testing.T) {
	c := NewChecked(7, 3, 40) // 120 bits: two words
	c.Mark([]int{0, 2}, 10, 30)
	c.Mark([]int{1}, 0, 40)
	for _, tc := range []struct {
		keys        []int
		first, end  int
		want        bool
		explanation string
	}{
		{[]int{0, 2}, 10, 30, true, "the marked range"},
		{[]int{0}, 12, 13, true, "inside it"},
		{[]int{0, 2}, 9, 30, false, "a layer before it"},
		{[]int{2}, 10, 31, false, "a layer after it"},
		{[]int{1}, 0, 40, true, "a key marked whole, across both words"},
		{[]int{0, 1}, 0, 40, false, "a key marked whole beside one marked in part"},
		{[]int{3}, 10, 11, false, "a key out of range"},
		{[]int{-1}, 10, 11, false, "a negative key"},
		{[]int{1}, 39, 41, false, "layers past the file's"},
		{[]int{1}, 5, 4, false, "an inverted range"},
		{nil, 0, 40, true, "no key asked"},
	} {
		if got := c.Covers(tc.keys, tc.first, tc.end); got != tc.want {
			t.Errorf("%s: Covers(%v, %d, %d) = %v, want %v", tc.explanation, tc.keys, tc.first, tc.end, got, tc.want)
		}
	}
	if !c.Of(3, 40) || c.Of(3, 41) || c.Of(4, 40) {
		t.Error("Of does not tell the record's shape")
	}
}
