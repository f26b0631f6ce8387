module github.com/settle-go/settle/e2e

go 1.26.8

// The browser tests drive the console of the directory above, not a
// release; chromedp stays out of the library's go.mod.
replace github.com/settle-go/settle => ../

require github.com/chromedp/chromedp v0.23.0

require (
	github.com/chromedp/cdproto v0.159.0 // indirect
	github.com/go-json-experiment/json v0.0.0-20260213210345-44df1a37e875 // indirect
)
