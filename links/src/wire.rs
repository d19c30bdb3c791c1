//! Conversion between chip messages and protobuf envelopes, with every check a message from
//! another process needs: known codes, a destination this worker hosts, a source the sending
//! worker hosts, a link that really joins them, sane sizes and times. A bad envelope is an
//! error naming what was wrong, never a panic or an oversized allocation.

use podsim_collectives::{DType, Fingerprint, Message, OpKind, Payload, ReduceOp, Run, Tag};
use podsim_proto::v1 as pb;
use podsim_topology::{Dir, Link, Placement, Pod, Route};

/// Largest frame accepted on a link stream, bytes.
pub const MAX_FRAME_BYTES: usize = 256 << 20;

/// A payload of one run of values seen as its bytes: their little-endian encoding on a
/// little-endian host.
struct LittleEndianValues(Payload);

impl AsRef<[u8]> for LittleEndianValues {
    fn as_ref(&self) -> &[u8] {
        match self.0.as_rope().and_then(|r| r.runs().next()) {
            Some(Run::Values(values)) => bytemuck::cast_slice(values),
            _ => &[],
        }
    }
}

pub fn encode(msg: Message) -> pb::Envelope {
    let link = match msg.link {
        Link::Ici { axis, dir } => pb::LinkId {
            kind: pb::link_id::Kind::Ici as i32,
            axis: u32::from(axis),
            positive: dir == Dir::Plus,
            peer_slice: 0,
        },
        Link::Dcn { peer_slice } => pb::LinkId {
            kind: pb::link_id::Kind::Dcn as i32,
            axis: 0,
            positive: false,
            peer_slice,
        },
    };
    let fp = msg.fingerprint;
    let body = match msg.payload.resolve() {
        Payload::Meta(n) => pb::payload::Body::MetaElements(n as u64),
        // The values' own memory is the field's bytes (the payload is made one buffer first,
        // without a copy when it is one already): the codec copies it once, into the frame.
        other if cfg!(target_endian = "little") => {
            let one_buffer = Payload::from_vec(other.into_vec().unwrap_or_default());
            pb::payload::Body::F32Le(bytes::Bytes::from_owner(LittleEndianValues(one_buffer)))
        }
        other => {
            let mut bytes = Vec::with_capacity(other.len() * 4);
            other.write_f32_le(&mut bytes);
            pb::payload::Body::F32Le(bytes.into())
        }
    };
    pb::Envelope {
        src_chip: msg.src,
        dst_chip: msg.dst,
        link: Some(link),
        fingerprint: Some(pb::Fingerprint {
            group: fp.group,
            seq: fp.seq,
            op: fp.op.code(),
            dtype: fp.dtype.code(),
            count: fp.count,
            reduce_op: fp.reduce.map_or(0, ReduceOp::code),
        }),
        tag: Some(pb::Tag {
            lane: u32::from(msg.tag.lane),
            phase: u32::from(msg.tag.phase),
            step: msg.tag.step,
        }),
        arrive_ns: msg.arrive_ns,
        payload: Some(pb::Payload { body: Some(body) }),
        checksum: msg.checksum,
        hops: msg.hops,
    }
}

/// Decodes an envelope that worker `from` sent to worker `me`.
pub fn decode(
    mut env: pb::Envelope,
    pod: &Pod,
    placement: &Placement,
    from: u32,
    me: u32,
) -> Result<Message, String> {
    let body = env.payload.take().and_then(|p| p.body);
    let payload = move || match body {
        Some(pb::payload::Body::MetaElements(n)) => Ok(Payload::Meta(
            usize::try_from(n).map_err(|_| format!("{n} elements"))?,
        )),
        Some(pb::payload::Body::F32Le(bytes)) => Payload::from_f32_le(&bytes)
            .ok_or_else(|| format!("payload of {} bytes is not whole f32 values", bytes.len())),
        None => Err("envelope without a payload".into()),
    };
    message(env, payload, pod, placement, from, me)
}

/// The message of an envelope whose payload comes apart from it (`env.payload` unused), with
/// every check of [`decode`]; `payload` is asked for once the envelope's fields passed.
pub fn message(
    env: pb::Envelope,
    payload: impl FnOnce() -> Result<Payload, String>,
    pod: &Pod,
    placement: &Placement,
    from: u32,
    me: u32,
) -> Result<Message, String> {
    let chips = pod.chips();
    if env.src_chip >= chips || env.dst_chip >= chips {
        return Err(format!(
            "chip {} -> {} is outside the pod of {chips} chips",
            env.src_chip, env.dst_chip
        ));
    }
    if placement.worker_of(env.src_chip) != from {
        return Err(format!(
            "worker {from} sent a message from chip {} it does not host",
            env.src_chip
        ));
    }
    if placement.worker_of(env.dst_chip) != me {
        return Err(format!(
            "a message for chip {} reached worker {me}, which does not host it",
            env.dst_chip
        ));
    }
    let link = link_of(env.link.as_ref().ok_or("envelope without a link")?)?;
    let fingerprint = fingerprint_of(
        env.fingerprint
            .as_ref()
            .ok_or("envelope without a fingerprint")?,
    )?;
    let route = Route {
        link,
        hops: env.hops.max(1),
    };
    // A point-to-point message leaves on the first link of its path; a collective's message
    // goes along one axis to the chip its route names.
    let joins = if fingerprint.op == OpKind::SendRecv {
        pod.path(env.src_chip, env.dst_chip)
            .is_some_and(|path| path.link == link)
    } else {
        pod.route_peer(env.src_chip, route) == Some(env.dst_chip)
    };
    if !joins {
        return Err(format!(
            "route {route} does not join chip {} to chip {}",
            env.src_chip, env.dst_chip
        ));
    }
    let t = env.tag.ok_or("envelope without a tag")?;
    let tag = Tag {
        lane: u16::try_from(t.lane).map_err(|_| format!("lane {} out of range", t.lane))?,
        phase: u16::try_from(t.phase).map_err(|_| format!("phase {} out of range", t.phase))?,
        step: t.step,
    };
    if !(env.arrive_ns.is_finite() && env.arrive_ns >= 0.0) {
        return Err(format!("arrival time {} is not a time", env.arrive_ns));
    }
    let payload = payload()?;
    Ok(Message {
        src: env.src_chip,
        dst: env.dst_chip,
        link,
        hops: route.hops,
        fingerprint,
        tag,
        arrive_ns: env.arrive_ns,
        payload,
        checksum: env.checksum,
    })
}

/// The link a message's envelope names.
fn link_of(l: &pb::LinkId) -> Result<Link, String> {
    match pb::link_id::Kind::try_from(l.kind) {
        Ok(pb::link_id::Kind::Ici) if l.axis < 3 => Ok(Link::ici(
            l.axis as usize,
            if l.positive { Dir::Plus } else { Dir::Minus },
        )),
        Ok(pb::link_id::Kind::Dcn) => Ok(Link::Dcn {
            peer_slice: l.peer_slice,
        }),
        _ => Err(format!("unknown link kind {} / axis {}", l.kind, l.axis)),
    }
}

/// The collective a message's envelope says it belongs to.
fn fingerprint_of(f: &pb::Fingerprint) -> Result<Fingerprint, String> {
    Ok(Fingerprint {
        group: f.group,
        seq: f.seq,
        op: OpKind::from_code(f.op).ok_or_else(|| format!("unknown op code {}", f.op))?,
        dtype: DType::from_code(f.dtype)
            .ok_or_else(|| format!("unknown dtype code {}", f.dtype))?,
        count: f.count,
        reduce: match f.reduce_op {
            0 => None,
            c => Some(ReduceOp::from_code(c).ok_or_else(|| format!("unknown reduce op code {c}"))?),
        },
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Message `seq` of chip `src` to chip 0 over the x+ link, carrying `payload` (for tests
    /// of the transports).
    pub(crate) fn message(src: u32, seq: u32, payload: Payload) -> Message {
        Message {
            src,
            dst: 0,
            link: Link::Ici {
                axis: 0,
                dir: Dir::Plus,
            },
            hops: 1,
            fingerprint: Fingerprint {
                group: 1,
                seq: u64::from(seq),
                op: OpKind::AllReduce,
                dtype: DType::F32,
                count: payload.len() as u64,
                reduce: Some(ReduceOp::Sum),
            },
            tag: Tag {
                lane: 0,
                phase: 0,
                step: seq,
            },
            arrive_ns: 0.0,
            payload,
            checksum: None,
        }
    }

    #[test]
    fn payload_bytes_are_the_values_little_endian_however_the_payload_is_made() {
        let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let b: Vec<f32> = (0..1000).map(|i| (i % 13) as f32).collect();
        let pa = Payload::from_vec(a.clone());
        let pb_ = Payload::from_vec(b.clone());
        let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let pieces = [a[..300].to_vec(), vec![0.0; 50], b[..10].to_vec()].concat();
        let cases = [
            (pa.clone(), a.clone()),
            (
                pa.clone()
                    .combine(&pb_, ReduceOp::Sum)
                    .unwrap_or(pa.clone()),
                sum,
            ),
            (
                Payload::concat([pa.slice(0, 300), pa.zeros_like(50), pb_.slice(0, 10)]),
                pieces,
            ),
            (Payload::from_vec(Vec::new()), Vec::new()),
        ];
        for (payload, values) in cases {
            let env = encode(message(1, 1, payload));
            let Some(pb::payload::Body::F32Le(bytes)) = env.payload.and_then(|p| p.body) else {
                panic!("no values");
            };
            let expected: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(bytes.as_ref(), expected.as_slice());
        }
    }
}
