package fstype

import (
	"errors"
	"io/fs"
	"strings"
	"testing"
)

func TestLargeFolioFollowsTheMountAndTheKernelSetting(t *testing.T) {
	const pmd = 2 << 20
	const never = "always within_size advise [never] deny force"
	cases := []struct {
		name    string
		typ     string
		options string
		enabled string
		want    int64
	}{
		{"tmpfs without huge", "tmpfs", "rw,relatime,size=4194304k", never, 0},
		{"huge=within_size", "tmpfs", "rw,size=40g,huge=within_size", never, pmd},
		{"huge=always", "tmpfs", "rw,huge=always", never, pmd},
		{"huge=advise: writes get small pages", "tmpfs", "rw,huge=advise", never, 0},
		{"huge=never", "tmpfs", "rw,huge=never", never, 0},
		{"force makes every tmpfs huge", "tmpfs", "rw", "always within_size advise never deny [force]", pmd},
		{"deny overrides the mount", "tmpfs", "rw,huge=always", "always within_size advise never [deny] force", 0},
		{"not tmpfs", "ext4", "rw,huge=always", "always within_size advise never deny [force]", 0},
		{"ramfs", "ramfs", "rw", "always within_size advise never deny [force]", 0},
		{"no bracket: the bare word", "tmpfs", "rw", "force\n", pmd},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := Mount{Point: "/mnt/kv", Type: c.typ, Options: c.options}
			if got := LargeFolio(m, c.enabled, pmd); got != c.want {
				t.Errorf("LargeFolio = %d, want %d", got, c.want)
			}
		})
	}
	if got := LargeFolio(Mount{Type: "tmpfs", Options: "huge=always"}, never, 0); got != 0 {
		t.Errorf("without a huge page size: %d, want 0", got)
	}
	if got := LargeFolio(Mount{Type: "tmpfs", Options: "huge=always"}, never, 512<<20); got != 0 {
		t.Errorf("512 MiB huge pages (arm64, 64 KiB base pages): %d, want 0 (above MaxLargeFolio)", got)
	}
}

func TestParseMountInfoKeepsSuperOptions(t *testing.T) {
	const info = "60 22 0:60 / /mnt/kvh rw,relatime - tmpfs kvh rw,size=41943040k,huge=within_size,inode64\n" +
		"61 22 0:61 / /mnt/bare rw - tmpfs bare\n"
	ms, err := ParseMountInfo(strings.NewReader(info))
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := ms[0].Option("huge"); !ok || v != "within_size" {
		t.Errorf("huge = %q, %v; want within_size", v, ok)
	}
	if _, ok := ms[0].Option("hug"); ok {
		t.Error("a prefix of an option's name matched")
	}
	if ms[1].Options != "" {
		t.Errorf("a line without super options: %q", ms[1].Options)
	}
}

func TestUnreadableSettingsAreAnErrorOnlyWhereTheMountAsksForHugePages(t *testing.T) {
	hidden := func() (string, int64, error) { return "", 0, fs.ErrNotExist }
	for _, c := range []struct {
		options string
		wantErr bool
	}{
		{"rw,huge=within_size", true},
		{"rw,huge=always", true},
		{"rw,huge=advise", false},
		{"rw", false},
	} {
		folio, err := largeFolioFor(Mount{Point: "/mnt/kv", Type: "tmpfs", Options: c.options}, hidden)
		if folio != 0 || (err != nil) != c.wantErr {
			t.Errorf("%s: %d, %v; want 0 and an error %v", c.options, folio, err, c.wantErr)
		}
		if err != nil && (!errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "/mnt/kv")) {
			t.Errorf("%s: error %v does not wrap the cause or name the mount", c.options, err)
		}
	}
	readable := func() (string, int64, error) { return "always within_size advise [never] deny force", 2 << 20, nil }
	if folio, err := largeFolioFor(Mount{Type: "tmpfs", Options: "huge=within_size"}, readable); folio != 2<<20 || err != nil {
		t.Errorf("readable settings: %d, %v; want 2 MiB", folio, err)
	}
}

// TestHugeOptionReadsTheMountsHugeSetting: a tmpfs without huge= is
// "never"; always and within_size ask for huge pages, advise and never do
// not.
func TestHugeOptionReadsTheMountsHugeSetting(t *testing.T) {
	for _, tc := range []struct {
		options, huge string
		asks          bool
	}{
		{"rw,size=4194304k", "never", false},
		{"rw,huge=always", "always", true},
		{"rw,size=1g,huge=within_size", "within_size", true},
		{"rw,huge=advise", "advise", false},
		{"rw,huge=never", "never", false},
	} {
		huge, asks := HugeOption(Mount{Type: "tmpfs", Options: tc.options})
		if huge != tc.huge || asks != tc.asks {
			t.Errorf("%q: huge %q, asks %v; want %q, %v", tc.options, huge, asks, tc.huge, tc.asks)
		}
	}
}
