package kvhost_test

import (
	"errors"
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// methodLimit is the most methods a named type under internal/engine
// may have; methodLimits raises it for the types named there.
const methodLimit = 50

// methodLimits are the types allowed more than methodLimit methods, by
// "package-directory.Type": Engine is the composition root, where the
// parts meet, and holds at most 80.
var methodLimits = map[string]int{
	"internal/engine.Engine": 80,
}

// pendingMethodLimits are types over their limit while the split that
// brings them under it is under way (issue 96), with the most methods
// each may have meanwhile. Like pendingViolations, each must still be
// over methodLimit: remove it when its split lands.
var pendingMethodLimits = map[string]int{}

// methodCounts counts the methods of each named type declared in the
// non-test Go files under root, by "directory.Type" (directory relative
// to the module root). A method declared in two files that build tags
// keep apart (an invariants file and its stand-in) counts once.
func methodCounts(t *testing.T, root string) map[string]int {
	t.Helper()
	methods := map[string]map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok || fd.Recv == nil || len(fd.Recv.List) == 0 {
				continue
			}
			key := filepath.ToSlash(filepath.Dir(p)) + "." + receiverType(fd.Recv.List[0].Type)
			if methods[key] == nil {
				methods[key] = map[string]bool{}
			}
			methods[key][fd.Name.Name] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	for k, m := range methods {
		counts[k] = len(m)
	}
	return counts
}

// TestHouseNoEngineTypeHasOver50Methods: no named type under
// internal/engine has more than 50 methods (Engine, the composition
// root, at most 80). A type past its limit holds more than one concern:
// split its state into named parts, each with its own type and file,
// rather than raise the limit.
func TestHouseNoEngineTypeHasOver50Methods(t *testing.T) {
	counts := methodCounts(t, "internal/engine")
	if counts["internal/engine.Engine"] == 0 {
		t.Fatal("found no methods of internal/engine.Engine: the count reads the wrong tree")
	}
	for _, limits := range []map[string]int{methodLimits, pendingMethodLimits} {
		for key := range limits {
			if _, ok := counts[key]; !ok {
				t.Errorf("a limit names %s, which has no methods: remove it", key)
			}
		}
	}
	var keys []string
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		limit, ok := methodLimits[k]
		if !ok {
			limit = methodLimit
		}
		if pending, ok := pendingMethodLimits[k]; ok {
			if counts[k] <= limit {
				t.Errorf("%s has %d methods, within its limit of %d: remove it from pendingMethodLimits", k, counts[k], limit)
			}
			limit = pending
		}
		if counts[k] > limit {
			t.Errorf("%s has %d methods, over its limit of %d: split its state by concern into parts of their own", k, counts[k], limit)
		}
		t.Logf("%s: %d methods", k, counts[k])
	}
}

// viewedPackages are the engine's packages whose tests read the parts'
// test views (inspect.go: Inspect, Forget, ...), which are built only
// with -tags invariants; so are those tests, every file of them, so that
// a build without the tag (vet, staticcheck) never finds a test calling
// a view it lacks.
var viewedPackages = []string{"internal/engine", "internal/engine/cluster"}

// TestHouseTestViewsAreBuiltOnlyWithTheInvariantsTag: no engine
// package's build without -tags invariants holds a test view (a file
// inspect.go), and viewedPackages have no test file in that build.
func TestHouseTestViewsAreBuiltOnlyWithTheInvariantsTag(t *testing.T) {
	views := 0
	err := filepath.WalkDir("internal/engine", func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		pkg, err := build.ImportDir(p, 0)
		if err != nil {
			var none *build.NoGoError
			if errors.As(err, &none) {
				return nil
			}
			return err
		}
		if slices.Contains(pkg.GoFiles, "inspect.go") {
			t.Errorf("%s/inspect.go, the part's test views, is in the build without -tags invariants: begin it with //go:build invariants", p)
		}
		if slices.Contains(pkg.IgnoredGoFiles, "inspect.go") {
			views++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if views == 0 {
		t.Fatal("found no test views under internal/engine: the check reads the wrong tree")
	}
	for _, dir := range viewedPackages {
		pkg, err := build.ImportDir(dir, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range slices.Concat(pkg.TestGoFiles, pkg.XTestGoFiles) {
			t.Errorf("%s/%s is built without -tags invariants: begin it with //go:build invariants, as every test of %s (they read the parts' test views)", dir, f, dir)
		}
	}
}
