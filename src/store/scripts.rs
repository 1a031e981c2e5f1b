//! The Lua scripts of `lua/`, embedded at build time so the binary and the files that
//! other languages use can never drift apart.

use redis::Script;

pub struct Scripts {
    pub put: Script,
    pub delete: Script,
    pub reserve: Script,
    pub pull: Script,
    pub release: Script,
    pub retry: Script,
    pub requeue: Script,
    pub get: Script,
    pub stats: Script,
    pub list: Script,
    pub check: Script,
}

/// Script sources by file name, for `SCRIPT LOAD` and for tests that call them raw.
pub const SOURCES: [(&str, &str); 11] = [
    ("put", include_str!("../../lua/put.lua")),
    ("delete", include_str!("../../lua/delete.lua")),
    ("reserve", include_str!("../../lua/reserve.lua")),
    ("pull", include_str!("../../lua/pull.lua")),
    ("release", include_str!("../../lua/release.lua")),
    ("retry", include_str!("../../lua/retry.lua")),
    ("requeue", include_str!("../../lua/requeue.lua")),
    ("get", include_str!("../../lua/get.lua")),
    ("stats", include_str!("../../lua/stats.lua")),
    ("list", include_str!("../../lua/list.lua")),
    ("check", include_str!("../../lua/check.lua")),
];

impl Scripts {
    pub fn new() -> Self {
        let [put, delete, reserve, pull, release, retry, requeue, get, stats, list, check] =
            SOURCES.map(|(_, source)| Script::new(source));
        Self {
            put,
            delete,
            reserve,
            pull,
            release,
            retry,
            requeue,
            get,
            stats,
            list,
            check,
        }
    }

    pub fn all(&self) -> [&Script; 11] {
        [
            &self.put,
            &self.delete,
            &self.reserve,
            &self.pull,
            &self.release,
            &self.retry,
            &self.requeue,
            &self.get,
            &self.stats,
            &self.list,
            &self.check,
        ]
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}
