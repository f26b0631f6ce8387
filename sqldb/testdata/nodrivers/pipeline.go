//go:build pipeline

package main

import _ "github.com/settle-go/settle/pipeline"
