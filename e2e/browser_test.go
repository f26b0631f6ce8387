package e2e_test

import (
	"context"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// chromiumEnv names a browser binary other than /usr/bin/chromium.
const chromiumEnv = "SETTLE_CHROMIUM"

var screenshots = flag.String("screenshots", "", "write PNGs of the console's main pages into this directory (docs/images)")

// chromium returns the browser binary, or skips the test (fails it under
// SETTLE_REQUIRE_INTEGRATION=1) when there is none.
func chromium(t *testing.T) string {
	t.Helper()
	path := os.Getenv(chromiumEnv)
	if path == "" {
		path = "/usr/bin/chromium"
	}
	if _, err := exec.LookPath(path); err != nil {
		msg := "no browser at " + path + " (apt-get install chromium, or set $" + chromiumEnv + ")"
		if os.Getenv("SETTLE_REQUIRE_INTEGRATION") == "1" {
			t.Fatal(msg + ", and SETTLE_REQUIRE_INTEGRATION=1")
		}
		t.Skip(msg)
	}
	return path
}

// browser starts a headless Chromium with a fresh profile, closed when the
// test ends, and returns the context of its first tab.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromium(t)),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.UserDataDir(filepath.Join(t.TempDir(), "profile")),
		chromedp.WindowSize(1280, 860),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	// The first Run starts the browser, bound to ctx (no timeout on it).
	if err := chromedp.Do(ctx, chromedp.Navigate("about:blank")); err != nil {
		cancel()
		cancelAlloc()
		t.Fatalf("starting chromium: %v", err)
	}
	t.Cleanup(func() {
		if err := chromedp.Cancel(ctx); err != nil && !errors.Is(err, context.Canceled) {
			t.Logf("closing chromium: %v", err)
		}
		cancel()
		cancelAlloc()
	})
	return ctx
}

// tab opens another tab of the browser of ctx.
func tab(t *testing.T, ctx context.Context) context.Context {
	t.Helper()
	c, cancel := chromedp.NewContext(ctx)
	t.Cleanup(cancel)
	if err := chromedp.Do(c, chromedp.Navigate("about:blank")); err != nil {
		t.Fatal(err)
	}
	return c
}

// do runs steps with a deadline, failing the test on error.
func do(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := chromedp.Do(c, steps...); err != nil {
		t.Fatal(err)
	}
}

// run runs one action that returns a value, with a deadline.
func run[T any](t *testing.T, ctx context.Context, a chromedp.Action[T]) T {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	v, err := chromedp.Run(c, a)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// eval evaluates a JavaScript expression in the page.
func eval[T any](t *testing.T, ctx context.Context, expr string) T {
	t.Helper()
	return run(t, ctx, chromedp.Evaluate[T](expr))
}

// screenshot saves a PNG of the page as docs/images/console-<name>.png when
// -screenshots is set.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	if *screenshots == "" {
		return
	}
	png := run(t, ctx, chromedp.FullScreenshot(100))
	p := filepath.Join(*screenshots, "console-"+name+".png")
	if err := os.WriteFile(p, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s", p)
}
