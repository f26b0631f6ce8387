// Package redissub is what settle needs on Redis Streams.
package redissub
