package kvhost_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// makeVariable returns the value of a `NAME := value` line of the
// Makefile.
func makeVariable(t *testing.T, makefile, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s*:=\s*(.*)$`).FindStringSubmatch(makefile)
	if m == nil {
		t.Fatalf("the Makefile has no %s := line", name)
	}
	return strings.TrimSpace(m[1])
}

// TestNoraceTestsAreTestsOfTheirPackagesAlone: every name in the
// Makefile's NORACE_TESTS (which test-race skips in every package and
// test-norace runs without the race detector in NORACE_PKGS) is a test
// function of a package in NORACE_PKGS, and of no other package: a name
// no test has any more, or one another package shares, would leave a
// test out of both runs or out of the race detector unseen.
func TestNoraceTestsAreTestsOfTheirPackagesAlone(t *testing.T) {
	b, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	names := strings.Split(makeVariable(t, string(b), "NORACE_TESTS"), "|")
	var pkgs []string
	for _, p := range strings.Fields(makeVariable(t, string(b), "NORACE_PKGS")) {
		pkgs = append(pkgs, filepath.Clean(p))
	}
	found := map[string][]string{} // test name -> the directories that define it
	decl := regexp.MustCompile(`(?m)^func (Test\w+)\(t \*testing\.T\)`)
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range decl.FindAllStringSubmatch(string(src), -1) {
			found[m[1]] = append(found[m[1]], filepath.Dir(path))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(names) == 0 || len(pkgs) == 0 {
		t.Fatal("NORACE_TESTS or NORACE_PKGS is empty")
	}
	for _, name := range names {
		dirs := found[name]
		if len(dirs) == 0 {
			t.Errorf("NORACE_TESTS names %s, which no test function is", name)
		}
		for _, d := range dirs {
			if !slices.Contains(pkgs, d) {
				t.Errorf("%s is a test of %s, not in NORACE_PKGS: test-race would skip it there and test-norace not run it", name, d)
			}
		}
	}
}
