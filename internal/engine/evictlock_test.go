//go:build invariants

package engine

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"testing"
)

// TestEvictLockIsTakenOnlyInCapacityGo: no file of the package but
// capacity.go names mount.evictMu (the tests included): the eviction
// lock, the first of the engine's locks, is taken there alone, and
// elsewhere through withEvictLock and ifNotEvicting.
func TestEvictLockIsTakenOnlyInCapacityGo(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("found no Go files: the test reads the wrong directory")
	}
	inCapacity := 0
	for _, name := range files {
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok || sel.Sel.Name != "evictMu" {
				return true
			}
			if name == "capacity.go" {
				inCapacity++
			} else {
				t.Errorf("%s names evictMu: take the eviction lock through capacity.go (withEvictLock, ifNotEvicting)", fset.Position(sel.Pos()))
			}
			return true
		})
	}
	if inCapacity == 0 {
		t.Error("capacity.go names evictMu nowhere: the check looks for the wrong name")
	}
}
