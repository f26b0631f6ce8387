package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// The measures of the public API (issue #25): how many exported names the
// library's packages have, that no two differ only by the driver they run
// on, and how many ways there are to add a handler. They count what `go doc`
// shows a user: top-level functions, types, constants and variables, and
// the methods of exported types; not struct fields or interface methods.
//
// maxExported: 228 names at #25's close (its limit was 230), then
// middleware.TracePublished (1, the publisher decorator that ends a
// router-published delivery's settle span before router.Close returns) and,
// for the parked-message store and its tools (issue 26): package parked
// (28, with ErrInvalid), settle.Parked, settle.ParkStore, settle.MetaReplayedBy and
// settle.MetaReplayHandler (4), dedupe.KeyState, SQLStore.Lookup and
// SQLStore.InFlight (3), console.Config and console.New (2); then, for the
// brokers (issue 27), package natsjs (9: Config, NewSubscriber,
// NewPublisherConfig, Subscriber and its Subscribe, SubscribeInitialize,
// InFlight, AckWait, Close) and package redissub (9: Config,
// ErrInvalidConfig, NewSubscriber, Subscriber and its InFlight, Subscribe
// and Close, SubscriberConfig, CheckSubscriberConfig), and the broker conformance suite, brokertest.Run
// and brokertest.Harness (2); then SQLStore.AddPartitions (1, issue 29:
// the partitions of a partitioned claims table for keys older than the
// table, as in a migration); then natsjs.NewPublisher and
// middleware.MetaPayloadLeftOut (2: a parked copy on NATS measured against
// the server's bounds on one message, and the key a copy without its
// payload carries); then dedupe.Refused and SQLStore.Refuse (2: the refused
// key, which a transactional handler writing its own keys commits before it
// dead-letters a message with no attempt left, so that a frozen worker's
// delivery of the same message finds it and does not run).
const (
	maxExported    = 291
	maxHandlerWays = 8
)

// notLibrary are the directories whose packages a user does not import.
var notLibrary = []string{"internal", "cmd", "examples", "bench", "integration", "tools", "scripts", "testdata", "docs", "e2e"}

// exportedNames lists "dir.Name" and "dir.Type.Method" for every exported
// name of the library's packages under root.
func exportedNames(t *testing.T, root string) []string {
	t.Helper()
	var names []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (slices.Contains(notLibrary, d.Name()) || strings.HasPrefix(d.Name(), ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if f.Name.Name == "main" {
			return nil
		}
		dir, _ := filepath.Rel(root, filepath.Dir(p))
		for _, decl := range f.Decls {
			switch decl := decl.(type) {
			case *ast.FuncDecl:
				if !decl.Name.IsExported() {
					continue
				}
				if decl.Recv == nil {
					names = append(names, dir+"."+decl.Name.Name)
					continue
				}
				if recv := recvName(decl.Recv.List[0].Type); ast.IsExported(recv) {
					names = append(names, dir+"."+recv+"."+decl.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range decl.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							names = append(names, dir+"."+s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() {
								names = append(names, dir+"."+n.Name)
							}
						}
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(names)
	return names
}

func recvName(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.IndexExpr:
			e = x.X
		case *ast.IndexListExpr:
			e = x.X
		case *ast.Ident:
			return x.Name
		default:
			return ""
		}
	}
}

// TestExportedNames: the library stays within its budget of exported
// names, and no name has a twin for another driver.
func TestExportedNames(t *testing.T) {
	names := exportedNames(t, repoRoot(t))
	if len(names) > maxExported {
		t.Errorf("%d exported names in the library's packages, want <= %d", len(names), maxExported)
	}
	// The driver is named once, where a program opens its database
	// (sqldb.Std, sqldb.Pgx): anywhere else a name with Pgx in it is a
	// twin of one without.
	for _, n := range names {
		if pkg, rest, _ := strings.Cut(n, "."); pkg != "sqldb" && strings.Contains(rest, "Pgx") {
			t.Errorf("%s names a driver: the API has one way per concept, whatever the driver", n)
		}
	}
	if t.Failed() || testing.Verbose() {
		t.Logf("%d exported names:\n%s", len(names), strings.Join(names, "\n"))
	}
}

// TestWaysToAddAHandler: package pipeline has at most maxHandlerWays
// functions and methods that add a handler or build one.
func TestWaysToAddAHandler(t *testing.T) {
	dir := filepath.Join(repoRoot(t), "pipeline")
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	builds := []string{"message.HandlerFunc", "message.NoPublishHandlerFunc", "Handlers", "TxFunc", "BatchTxFunc"}
	var ways []string
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(dir, e.Name()), nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok || !fd.Name.IsExported() || fd.Type.Results == nil {
				continue
			}
			for _, r := range fd.Type.Results.List {
				if slices.Contains(builds, typeName(r.Type)) {
					ways = append(ways, fd.Name.Name)
					break
				}
			}
		}
	}
	sort.Strings(ways)
	if len(ways) > maxHandlerWays {
		t.Errorf("%d ways to add a handler, want <= %d: %s", len(ways), maxHandlerWays, strings.Join(ways, ", "))
	}
	t.Logf("ways to add a handler: %s", strings.Join(ways, ", "))
}

func typeName(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.Ident:
		return x.Name
	case *ast.SelectorExpr:
		if id, ok := x.X.(*ast.Ident); ok {
			return id.Name + "." + x.Sel.Name
		}
	case *ast.IndexExpr:
		return typeName(x.X)
	case *ast.IndexListExpr:
		return typeName(x.X)
	case *ast.StarExpr:
		return typeName(x.X)
	}
	return ""
}

// repoRoot is the module's root directory: two up from this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// TestLibraryLinksNoDriver: a program on settle's SQL packages links the
// database driver it imports itself and no other (importing settle
// registers none), and none of the benchmark harness's or the tests'
// dependencies.
func TestLibraryLinksNoDriver(t *testing.T) {
	cmd := exec.Command("go", "list", "-deps", "./sqldb", "./dedupe", "./outbox", "./pipeline", "./middleware", "./amqpsub", "./amqpmarshal", "./natsjs", "./redissub", "./poison", ".")
	cmd.Dir = repoRoot(t)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/go-sql-driver/", "github.com/lib/pq", "modernc.org/sqlite", "github.com/riverqueue/", "github.com/anishathalye/porcupine", "go.uber.org/goleak", "github.com/jackc/pgx/v5/stdlib"} {
			if strings.HasPrefix(dep, banned) {
				t.Errorf("the library links %s", dep)
			}
		}
	}
}
