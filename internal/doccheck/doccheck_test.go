package doccheck_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/settle-go/settle/internal/testenv"
)

// TestMain checks for leaked goroutines and says which services the tests
// used.
func TestMain(m *testing.M) { testenv.Main(m) }

// Every Go snippet of the guide is a whole file (package clause, imports,
// code) that type-checks and passes vet as shown: each is written into a
// package of its own inside this module and vetted with the module's
// dependencies. The files of the guide's whole program (a block under a
// "<!-- file: NAME -->" line) are one package together.
func TestGettingStartedSnippetsCompile(t *testing.T) {
	t.Parallel()
	all := snippets(t)
	if len(all) < 8 {
		t.Fatalf("found %d Go snippets in getting-started.md; the guide has more", len(all))
	}
	if err := os.MkdirAll("testdata", 0o755); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("testdata", "snippets-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	var pkgs []string
	for i, s := range all {
		if !strings.HasPrefix(s.src, "package ") {
			t.Errorf("snippet %d does not start with a package clause, so it does not compile as shown:\n%s", i+1, s.src)
			continue
		}
		pdir, file := filepath.Join(dir, fmt.Sprintf("s%02d", i+1)), "snippet.go"
		if s.file != "" {
			pdir, file = filepath.Join(dir, "program"), filepath.Base(s.file)
		}
		if err := os.MkdirAll(pdir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pdir, file), []byte(s.src), 0o644); err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, "./"+filepath.ToSlash(pdir))
	}
	cmd := exec.Command("go", append([]string{"vet"}, dedup(pkgs)...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go vet of the snippets (sNN is the NNth ```go block of docs/getting-started.md; program/ is the whole program): %v\n%s", err, out)
	}
}

func dedup(pkgs []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, p := range pkgs {
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out
}
