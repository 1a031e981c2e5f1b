//! The Lua scripts of `lua/`, embedded at build time so the binary and the files that
//! other languages use can never drift apart.
//!
//! To add a script: put `lua/<name>.lua` (with its header), add `<name>` to the list
//! below, and write its file in `ops/` (types, calls built with [`Scripts::call`],
//! reply decoding, typed method). Loading,
//! `NOSCRIPT` recovery and cluster routing come with it (`exec.rs`).

use redis::Script;

use super::call::Call;
use super::keys::KeySpace;
use crate::job::Topic;

/// The one list of scripts: a field of [`Scripts`] and an entry of [`SOURCES`] each.
macro_rules! scripts {
    ($($name:ident),* $(,)?) => {
        pub(crate) struct Scripts {
            $(pub(crate) $name: Script,)*
        }

        /// Script sources by file name, for `SCRIPT LOAD` and for tests that call them raw.
        pub const SOURCES: &[(&str, &str)] = &[
            $((stringify!($name), include_str!(concat!("../../lua/", stringify!($name), ".lua"))),)*
        ];

        impl Scripts {
            pub(crate) fn new() -> Self {
                Self {
                    $($name: Script::new(include_str!(concat!("../../lua/", stringify!($name), ".lua"))),)*
                }
            }

            /// The name of the script whose SHA1 is `hash`, if it is one of these.
            pub(crate) fn name_of(&self, hash: &[u8]) -> Option<&'static str> {
                $(if self.$name.get_hash().as_bytes() == hash {
                    return Some(stringify!($name));
                })*
                None
            }
        }
    };
}

scripts!(
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
    pause,
    resume,
    redrive,
    redrive_window,
    history,
    due_histogram,
    rate_limit,
    delete_prefix,
    target_health,
);

impl Scripts {
    /// An `EVALSHA` of `script` on one topic's keys; add arguments with [`Call::arg`].
    /// Every per-topic script takes the topic's full key list ([`KeySpace::all`]).
    pub(crate) fn call(script: &Script, topic: &Topic, keys: &KeySpace) -> Call {
        Self::call_with_keys(script, topic, keys.lists(topic).all())
    }

    /// [`Scripts::call`] with an explicit key list (all under the topic's hash tag).
    pub(crate) fn call_with_keys(script: &Script, topic: &Topic, keys: &[String]) -> Call {
        Self::call_sized(script, topic, keys, 16, 128)
    }

    /// [`Scripts::call_with_keys`] with room for `more_args` arguments of `more_bytes`
    /// in all after the keys: the command's buffers are sized once instead of growing
    /// (and being copied) argument by argument.
    pub(crate) fn call_sized(
        script: &Script,
        topic: &Topic,
        keys: &[String],
        more_args: usize,
        more_bytes: usize,
    ) -> Call {
        let hash = script.get_hash();
        let bytes = "EVALSHA".len() + hash.len() + 4 + keys.iter().map(String::len).sum::<usize>();
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + more_args, bytes + more_bytes);
        cmd.arg("EVALSHA").arg(hash).arg(keys.len()).arg(keys);
        Call::on_topic(topic, cmd)
    }

    /// `SCRIPT LOAD` of every script (a cluster client sends it to every primary).
    pub(crate) fn loads(&self) -> Vec<Call> {
        SOURCES
            .iter()
            .map(|(_, source)| {
                let mut cmd = redis::cmd("SCRIPT");
                cmd.arg("LOAD").arg(*source);
                Call::global(cmd)
            })
            .collect()
    }
}
