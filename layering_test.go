package kvhost_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// module is this repository's module path.
const module = "github.com/kvhost/kvhost"

// publicPackages is what a module outside kvhost may import: a decision,
// not a listing. Every other package of the module lives under an
// internal/ directory; a new package outside internal/ fails
// TestLayeringPublicPackagesAreListed until it is added here. A
// pattern ending in "/..." names a directory and all below it. "" is
// the module root, which holds only repository tests.
var publicPackages = []string{
	"",
	"abi",
	"abi/guest",
	"client",
	"protocol",
	"outcome",
	"fsys",
	"fsys/fsystest",
	"region",
	"transfer",
	"cuda",
	"cuda/cudatest",
	"gds",
	"staging",
	"staging/gpu",
	"host/policy",
	"host/policy/conformance",
	"host/policy/policytest",
	"plugins/...", // guest code: policies built to wasm
	"examples/...",
	"cmd/kvhost",  // the daemon's main
	"cmd/s3local", // a test S3 endpoint's main (internal/s3local)
}

// Selectors a rule's from, to and except may use beside package
// patterns (module-relative, "dir/..." for a directory and below).
const (
	selAny    = "kvhost"  // any package of the module
	selPublic = "public"  // a package publicPackages lists
	selLib    = "publib"  // a public package that is not a main
	selLeaf   = "leaf"    // an internal package that imports no package of the module
	selVocab  = "vocab"   // the leaf vocabulary packages, vocabulary below
	selImpl   = "pubimpl" // the public implementation packages, implementations below
)

// vocabulary are the packages whose types every layer speaks: they
// import no package of the module but internal leaf helpers and each
// other.
var vocabulary = []string{"abi", "protocol", "outcome", "fsys", "region", "transfer"}

// implementations are the public packages that move bytes; only the
// daemon's assembly wires them in.
var implementations = []string{"gds", "staging", "staging/gpu"}

// importRule forbids imports from the packages from selects of the
// packages to selects, except those except selects. Each selector list
// is space-separated; a selector prefixed with '!' takes what it selects
// out of the list's selection.
type importRule struct {
	rule, from, to, except, why string
}

// importRules is the layering as a table: adding a rule is one line.
var importRules = []importRule{
	{"engine-no-wire", "internal/engine/...", "protocol", "",
		"the engine is a library of the daemon, not of its wire protocol: it has its own outcome vocabulary and the server translates"},
	{"engine-no-movers", "internal/engine/...", "gds staging staging/gpu", "",
		"the engine moves bytes through transfer.Mover; the daemon's assembly picks the movers"},
	{"metrics-reads-snapshots", "internal/metrics", selAny, selLeaf + " outcome",
		"metrics reads snapshots through interfaces and types it defines (but the outcome vocabulary, which every layer speaks); the assembly adapts the parts to them"},
	{"public-no-daemon", selLib, "internal/engine/... internal/server/... internal/daemon/... internal/metrics/... internal/config/...", "",
		"a public library stands without the daemon: a module outside kvhost must be able to use it"},
	{"vocabulary-is-leaf", selVocab, selAny, selVocab + " " + selLeaf,
		"the shared vocabulary depends on nothing that speaks it"},
	{"internal-no-impl", "internal/... !internal/daemon/...", selImpl, "",
		"no internal package but the daemon's assembly imports a public implementation package"},
	{"engine-parts-apart", "internal/engine/... !internal/engine !internal/engine/cluster", "internal/engine/...", "",
		"each part of the engine owns one piece of its state and its lock; parts meet in the engine, which composes them"},
	{"engine-cluster-reads-two-parts", "internal/engine/cluster", "internal/engine/...", "internal/engine/index internal/engine/space",
		"the cluster part accounts the index's files against the space's bound; it reads no other part"},
}

// pendingViolations are imports importRules forbid that current code
// still makes while the work that removes them is under way. The test
// passes while each occurs and fails once one no longer does: remove
// it from this list when the work lands.
var pendingViolations = []struct{ from, to string }{}

// pendingAPI are places where a public package's exported API still
// names an internal type while the work that removes them waits, as
// "pkg.Ident internal-type". Like pendingViolations, each must still
// occur: remove it when it no longer does.
var pendingAPI = []string{}

// listedPackage is what the layering test reads from go list.
type listedPackage struct {
	ImportPath string
	Name       string
	Dir        string
	GoFiles    []string
	CgoFiles   []string
	Imports    []string
}

// listPackages lists the module's packages with go list.
func listPackages(t *testing.T) []listedPackage {
	t.Helper()
	cmd := exec.Command("go", "list", "-json", "./...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	var pkgs []listedPackage
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p listedPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) == 0 {
		t.Fatal("go list found no packages")
	}
	return pkgs
}

// rel is path's module-relative form, "" for the module root, and
// false for a path outside the module.
func rel(p string) (string, bool) {
	if p == module {
		return "", true
	}
	r, ok := strings.CutPrefix(p, module+"/")
	return r, ok
}

// matchPattern reports whether the module-relative path r matches
// pattern ("dir/..." matches dir and everything below it).
func matchPattern(pattern, r string) bool {
	if dir, ok := strings.CutSuffix(pattern, "/..."); ok {
		return r == dir || strings.HasPrefix(r, dir+"/")
	}
	return r == pattern
}

func isInternal(r string) bool {
	return strings.HasPrefix(r, "internal/") || strings.Contains(r, "/internal/")
}

func isPublic(r string) bool {
	return slices.ContainsFunc(publicPackages, func(p string) bool { return matchPattern(p, r) })
}

// graph is the module's packages by module-relative path.
type graph map[string]listedPackage

func newGraph(pkgs []listedPackage) graph {
	g := graph{}
	for _, p := range pkgs {
		if r, ok := rel(p.ImportPath); ok {
			g[r] = p
		}
	}
	return g
}

// kvhostImports are the module-relative paths of the module's packages
// r imports.
func (g graph) kvhostImports(r string) []string {
	var out []string
	for _, imp := range g[r].Imports {
		if ir, ok := rel(imp); ok {
			out = append(out, ir)
		}
	}
	return out
}

// selects reports whether the selector list sel selects package r.
func (g graph) selects(sel, r string) bool {
	var hit bool
	for _, s := range strings.Fields(sel) {
		if neg, ok := strings.CutPrefix(s, "!"); ok {
			if g.selectsOne(neg, r) {
				return false
			}
			continue
		}
		hit = hit || g.selectsOne(s, r)
	}
	return hit
}

// selectsOne reports whether the single selector s selects package r.
func (g graph) selectsOne(s, r string) bool {
	switch s {
	case selAny:
		return true
	case selPublic:
		return !isInternal(r) && isPublic(r)
	case selLib:
		return !isInternal(r) && isPublic(r) && g[r].Name != "main"
	case selLeaf:
		return isInternal(r) && len(g.kvhostImports(r)) == 0
	case selVocab:
		return slices.Contains(vocabulary, r)
	case selImpl:
		return slices.Contains(implementations, r)
	}
	return matchPattern(s, r)
}

// TestLayeringPublicPackagesAreListed: every package of the module is
// either internal or listed in publicPackages, and every entry of the
// list still names a package.
func TestLayeringPublicPackagesAreListed(t *testing.T) {
	g := newGraph(listPackages(t))
	used := map[string]bool{}
	for r := range g {
		if isInternal(r) {
			continue
		}
		matched := false
		for _, p := range publicPackages {
			if matchPattern(p, r) {
				used[p], matched = true, true
			}
		}
		if !matched {
			t.Errorf("%s is public but not in publicPackages: move it under internal/ or decide it is public and list it", path.Join(module, r))
		}
	}
	for _, p := range publicPackages {
		if !used[p] {
			t.Errorf("publicPackages lists %q, which names no package: remove it", p)
		}
	}
}

// TestLayeringImportRules: no package makes an import importRules
// forbids, but those pendingViolations lists, and each of those is
// still made.
func TestLayeringImportRules(t *testing.T) {
	g := newGraph(listPackages(t))
	for _, rule := range importRules {
		for _, s := range []string{rule.from, rule.to, rule.except} {
			for _, f := range strings.Fields(s) {
				f = strings.TrimPrefix(f, "!")
				if !strings.HasSuffix(f, "/...") && !slices.Contains([]string{selAny, selPublic, selLib, selLeaf, selVocab, selImpl}, f) {
					if _, ok := g[f]; !ok {
						t.Errorf("rule %s names %q, which is no package: fix the rule", rule.rule, f)
					}
				}
			}
		}
	}
	pending := map[[2]string]bool{}
	for _, p := range pendingViolations {
		pending[[2]string{p.from, p.to}] = false
	}
	var froms []string
	for r := range g {
		froms = append(froms, r)
	}
	sort.Strings(froms)
	for _, from := range froms {
		for _, to := range g.kvhostImports(from) {
			for _, rule := range importRules {
				if !g.selects(rule.from, from) || !g.selects(rule.to, to) || g.selects(rule.except, to) {
					continue
				}
				key := [2]string{from, to}
				if _, ok := pending[key]; ok {
					pending[key] = true
					continue
				}
				t.Errorf("%s imports %s, which rule %s forbids: %s", path.Join(module, from), path.Join(module, to), rule.rule, rule.why)
			}
		}
	}
	for _, p := range pendingViolations {
		if !pending[[2]string{p.from, p.to}] {
			t.Errorf("pending rule no longer violated: %s no longer imports %s; remove it from pendingViolations", p.from, p.to)
		}
	}
}

// TestLayeringPublicAPINamesPublicTypes: the exported API of a public
// package (exported functions, methods of exported types, exported
// types with their exported fields and methods, exported variables
// and constants with a type written out) names no type of an internal
// package, which a module outside kvhost could not name.
func TestLayeringPublicAPINamesPublicTypes(t *testing.T) {
	pkgs := listPackages(t)
	names := map[string]string{} // import path → package name
	for _, p := range pkgs {
		names[p.ImportPath] = p.Name
	}
	pending := map[string]bool{}
	for _, p := range pendingAPI {
		pending[p] = false
	}
	for _, p := range pkgs {
		r, ok := rel(p.ImportPath)
		if !ok || isInternal(r) || p.Name == "main" {
			continue
		}
		for _, f := range slices.Concat(p.GoFiles, p.CgoFiles) {
			for _, n := range internalNames(t, filepath.Join(p.Dir, f), r, names) {
				if _, ok := pending[n.key()]; ok {
					pending[n.key()] = true
					continue
				}
				t.Error(n)
			}
		}
	}
	for _, p := range pendingAPI {
		if !pending[p] {
			t.Errorf("pending API no longer names the internal type: %s; remove it from pendingAPI", p)
		}
	}
}

// apiName is one place an exported API names an internal type.
type apiName struct {
	ident string // pkg.Ident
	ref   internalRef
	at    token.Position
}

func (n apiName) key() string { return n.ident + " " + n.ref.name }

func (n apiName) String() string {
	return fmt.Sprintf("%s names internal type %s from %s (%s)", n.ident, n.ref.name, n.ref.path, n.at)
}

// internalNames parses file and lists each place its exported API
// names a type from an internal package, as "pkg.Ident names internal
// type X from path".
func internalNames(t *testing.T, file, pkg string, names map[string]string) []apiName {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	imports := map[string]string{} // name in file → import path
	for _, is := range f.Imports {
		p := strings.Trim(is.Path.Value, `"`)
		name := names[p]
		if name == "" {
			name = path.Base(p)
		}
		if is.Name != nil {
			name = is.Name.Name
		}
		imports[name] = p
	}
	var out []apiName
	check := func(ident string, expr ast.Node) {
		for _, x := range internalRefs(expr, imports) {
			out = append(out, apiName{pkg + "." + ident, x, fset.Position(x.pos)})
		}
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() {
				continue
			}
			ident := d.Name.Name
			if d.Recv != nil {
				recv := receiverType(d.Recv.List[0].Type)
				if !ast.IsExported(recv) {
					continue
				}
				ident = recv + "." + ident
			}
			check(ident, d.Type)
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.TypeSpec:
					if !s.Name.IsExported() {
						continue
					}
					if s.TypeParams != nil {
						check(s.Name.Name, s.TypeParams)
					}
					check(s.Name.Name, s.Type)
				case *ast.ValueSpec:
					if s.Type == nil {
						continue
					}
					for _, n := range s.Names {
						if n.IsExported() {
							check(n.Name, s.Type)
						}
					}
				}
			}
		}
	}
	return out
}

// receiverType is the name of a method receiver's base type.
func receiverType(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.IndexExpr:
			e = x.X
		case *ast.IndexListExpr:
			e = x.X
		case *ast.ParenExpr:
			e = x.X
		case *ast.Ident:
			return x.Name
		default:
			return ""
		}
	}
}

// internalRef is one qualified identifier from an internal package.
type internalRef struct {
	name, path string
	pos        token.Pos
}

// internalRefs lists the qualified identifiers of internal packages
// that the type expression n names where a user of the API sees them:
// unexported struct fields and interface methods are skipped.
func internalRefs(n ast.Node, imports map[string]string) []internalRef {
	var out []internalRef
	var walk func(ast.Node)
	walk = func(n ast.Node) {
		ast.Inspect(n, func(n ast.Node) bool {
			switch x := n.(type) {
			case *ast.StructType:
				walkFields(x.Fields, walk)
				return false
			case *ast.InterfaceType:
				walkFields(x.Methods, walk)
				return false
			case *ast.SelectorExpr:
				if id, ok := x.X.(*ast.Ident); ok {
					if p, ok := imports[id.Name]; ok {
						if r, ok := rel(p); ok && isInternal(r) {
							out = append(out, internalRef{id.Name + "." + x.Sel.Name, p, x.Pos()})
						}
					}
				}
				return false
			}
			return true
		})
	}
	walk(n)
	return out
}

// walkFields walks the types of the exported entries of a field list;
// an embedded entry counts as exported when its type's name is.
func walkFields(fl *ast.FieldList, walk func(ast.Node)) {
	if fl == nil {
		return
	}
	for _, f := range fl.List {
		exported := len(f.Names) == 0 && ast.IsExported(embeddedName(f.Type))
		for _, n := range f.Names {
			exported = exported || n.IsExported()
		}
		if exported {
			walk(f.Type)
		}
	}
}

// embeddedName is the name an embedded field or interface element
// goes by.
func embeddedName(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.StarExpr:
		return embeddedName(x.X)
	case *ast.SelectorExpr:
		return x.Sel.Name
	case *ast.IndexExpr:
		return embeddedName(x.X)
	case *ast.IndexListExpr:
		return embeddedName(x.X)
	case *ast.Ident:
		return x.Name
	}
	return ""
}

// outsideExample is a module outside kvhost's that uses its public
// packages (its go.mod replaces kvhost with this checkout).
const outsideExample = "examples/embed-staging"

// TestLayeringExampleBuildsOutsideTheModule builds a copy of
// outsideExample in a directory of its own, offline, its replace
// pointed at this checkout, and runs it: what it imports is usable from
// another module, which may import no internal package.
func TestLayeringExampleBuildsOutsideTheModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module")
	}
	root, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.CopyFS(dir, os.DirFS(outsideExample)); err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
	bin := filepath.Join(dir, "example")
	for _, args := range [][]string{
		{"go", "mod", "edit", "-replace", module + "=" + root},
		{"go", "build", "-o", bin, "."},
		{bin},
	} {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir, cmd.Env = dir, env
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestLayeringModuleRootHasNoCode keeps the root package a home for
// repository tests only, so that "" in publicPackages stays harmless.
func TestLayeringModuleRootHasNoCode(t *testing.T) {
	matches, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range matches {
		if !strings.HasSuffix(m, "_test.go") {
			t.Errorf("%s: the module root holds only tests", m)
		}
	}
	if _, err := os.Stat("go.mod"); err != nil {
		t.Fatal(err)
	}
}
