//go:build invariants

package engine

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strings"
	"testing"
)

// atForms pairs the operations of fsys.FS that a test file system may
// override with the form relative to a directory (fsys.AtFS) that the
// engine may use for the same operation instead.
var atForms = map[string]string{"OpenFile": "OpenAt", "Stat": "StatAt", "Remove": "RemoveAt", "Rename": "RenameAt"}

// TestTestFileSystemsThatOverrideAnOperationOverrideItsAtFormToo: a test
// file system embedding fsys.OS that overrides an operation (to inject a
// fault, to watch it) must override the operation's form relative to a
// directory as well: otherwise the engine reaches the OS through the
// embedded one wherever it uses that form, and the test checks nothing
// there. Read from this package's test files.
func TestTestFileSystemsThatOverrideAnOperationOverrideItsAtFormToo(t *testing.T) {
	fset := token.NewFileSet()
	ents, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	embedsOS := map[string]bool{}           // test types that embed fsys.OS
	methods := map[string]map[string]bool{} // their methods, by type
	for _, ent := range ents {
		if !strings.HasSuffix(ent.Name(), "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, ent.Name(), nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range file.Decls {
			switch d := decl.(type) {
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					ts, ok := spec.(*ast.TypeSpec)
					if !ok {
						continue
					}
					st, ok := ts.Type.(*ast.StructType)
					if !ok {
						continue
					}
					for _, f := range st.Fields.List {
						if sel, ok := f.Type.(*ast.SelectorExpr); ok && len(f.Names) == 0 && sel.Sel.Name == "OS" {
							if x, ok := sel.X.(*ast.Ident); ok && x.Name == "fsys" {
								embedsOS[ts.Name.Name] = true
							}
						}
					}
				}
			case *ast.FuncDecl:
				if d.Recv == nil || len(d.Recv.List) != 1 {
					continue
				}
				typ := d.Recv.List[0].Type
				if star, ok := typ.(*ast.StarExpr); ok {
					typ = star.X
				}
				if id, ok := typ.(*ast.Ident); ok {
					if methods[id.Name] == nil {
						methods[id.Name] = map[string]bool{}
					}
					methods[id.Name][d.Name.Name] = true
				}
			}
		}
	}
	if len(embedsOS) == 0 {
		t.Fatal("no test type embeds fsys.OS: the check reads nothing")
	}
	for typ := range embedsOS {
		for op, at := range atForms {
			if methods[typ][op] && !methods[typ][at] {
				t.Errorf("test file system %s overrides %s but not %s: the engine's %s calls reach the OS past it", typ, op, at, at)
			}
		}
	}
}
