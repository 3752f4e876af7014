//go:build invariants

package engine

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// partsWithoutEngine are the parts that take named collaborators, never
// the Engine (docs/engine.md, "The engine's parts").
var partsWithoutEngine = []string{"capacity", "sharedDir", "vllmReader"}

// structFieldsNamingEngine returns, for each struct type declared in f, the
// fields whose type names Engine (Engine, *Engine, []*Engine, …).
func structFieldsNamingEngine(f *ast.File) map[string][]string {
	found := map[string][]string{}
	for _, decl := range f.Decls {
		gd, ok := decl.(*ast.GenDecl)
		if !ok || gd.Tok != token.TYPE {
			continue
		}
		for _, spec := range gd.Specs {
			ts := spec.(*ast.TypeSpec)
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				continue
			}
			found[ts.Name.Name] = []string{} // declared, none yet
			for _, field := range st.Fields.List {
				names := false
				ast.Inspect(field.Type, func(n ast.Node) bool {
					if id, ok := n.(*ast.Ident); ok && id.Name == "Engine" {
						names = true
					}
					return true
				})
				if !names {
					continue
				}
				name := "(embedded)"
				if len(field.Names) > 0 {
					name = field.Names[0].Name
				}
				found[ts.Name.Name] = append(found[ts.Name.Name], name)
			}
		}
	}
	return found
}

// TestStructFieldsNamingEngineFindsAPlantedField: the check below sees an
// Engine field however it is spelled, and passes a struct without one.
func TestStructFieldsNamingEngineFindsAPlantedField(t *testing.T) {
	tests := []struct {
		name, src string
		want      []string
	}{
		{"pointer", "type capacity struct{ e *Engine; n int }", []string{"e"}},
		{"value", "type capacity struct{ e Engine }", []string{"e"}},
		{"embedded", "type capacity struct{ *Engine }", []string{"(embedded)"}},
		{"in a slice", "type capacity struct{ es []*Engine }", []string{"es"}},
		{"in a func", "type capacity struct{ f func() *Engine }", []string{"f"}},
		{"none", "type capacity struct{ ix *index.Index; log *slog.Logger }", []string{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := parser.ParseFile(token.NewFileSet(), "planted.go", "package engine\n"+tt.src, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			got, ok := structFieldsNamingEngine(f)["capacity"]
			if !ok {
				t.Fatalf("struct capacity not found in %q", tt.src)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("fields naming Engine in %q: %v, want %v", tt.src, got, tt.want)
			}
		})
	}
}

// TestPartsHoldNoEngine: capacity, sharedDir and vllmReader hold their
// collaborators by name; none has a field that reaches the Engine.
func TestPartsHoldNoEngine(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string][]string{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for typ, names := range structFieldsNamingEngine(f) {
			fields[typ] = append(fields[typ], names...)
		}
	}
	for _, part := range partsWithoutEngine {
		names, ok := fields[part]
		if !ok {
			t.Errorf("struct %s not found: the check reads the wrong directory or the part was renamed", part)
			continue
		}
		if len(names) > 0 {
			t.Errorf("%s holds the Engine in %v: give it the collaborators it uses instead", part, names)
		}
	}
}
